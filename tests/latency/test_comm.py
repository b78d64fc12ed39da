"""The vocabulary under tensor parallelism, as vLLM splits it: the embedding's all-reduce, the
LM head's slice of the (padded) vocabulary and the gather of the sampled rows' logits; one GPU
unchanged bit for bit; a profile's split refused at the scenario's field."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from sim.config.errors import InputError
from sim.hardware.gpus import GPUS
from sim.hardware.models import MODELS
from sim.hardware.parallelism import SINGLE_GPU, Parallelism
from sim.latency.base import BatchShape
from sim.latency.comm import CustomAllReduce, read_table
from sim.latency.gemm import GemmModel
from sim.latency.profile import ProfileConfig, ProfileLatency
from sim.latency.roofline import RooflineConfig, RooflineLatency
from tests.helpers import REPO

H100 = GPUS.get("h100-sxm")
LINK_S_PER_BYTE = 1 / (450e9 * 0.75)  # NVLink 4 one way, at the default efficiency
NETWORK = REPO.parent / "shared" / "profiles" / "vidur" / "network"


def roofline(model: str, tensor: int = 1, **params: object) -> RooflineLatency:
    return RooflineLatency(RooflineConfig.model_validate({"kind": "roofline", **params}),
                           MODELS.get(model), H100, Parallelism(tensor=tensor))


def mixed_shapes(seed: int, n: int) -> list[BatchShape]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prefill, decodes, cached = (int(x) for x in rng.integers(1, 3000, size=3))
        out.append(BatchShape(
            num_prefill_tokens=prefill, num_prefill_seqs=1, num_decode_tokens=decodes,
            num_sampled_tokens=decodes + 1,
            prefill_attn_pairs=prefill * cached + prefill * (prefill + 1) // 2,
            prefill_kv_tokens=cached + prefill, decode_kv_tokens=decodes * cached))
    return out


def test_the_lm_head_computes_a_vocabulary_slice_then_gathers_the_sampled_logits():
    model = MODELS.get("llama-3.1-70b")  # hidden 8192, vocabulary 128,256
    latency = roofline("llama-3.1-70b", tensor=4, linear="naive")
    flops_s, bytes_s = H100.peak_bf16_flops * 0.6, H100.memory_bandwidth_bytes_s * 0.8
    rows = 128_256 // 4
    for sampled in (1, 64, 4096):
        gemm_s = max(2 * sampled * 8192 * rows / flops_s, 8192 * rows * 2 / bytes_s)
        # Every GPU receives the other three slices: 3/4 of the sampled rows' bf16 logits.
        gather_s = 25e-6 + 3 / 4 * sampled * 128_256 * 2 * LINK_S_PER_BYTE
        decode = BatchShape.decode_only(sampled, sampled * 100)
        no_head = replace(decode, num_sampled_tokens=0)
        head_s = latency.iteration_time_s(decode) - latency.iteration_time_s(no_head)
        assert head_s == pytest.approx(gemm_s + gather_s, rel=1e-9)
    assert model.vocab_size == 128_256
    assert latency.tables.sampled_s(0) == 0.0


def test_the_embedding_all_reduce_and_the_logits_gather_take_the_per_layer_source():
    """A measured all-reduce table times the embedding's all-reduce as it times the layers';
    the logits' gather stays on the link (the tables hold no all-gather)."""
    table_path = NETWORK / "h100_dgx" / "all_reduce.csv"
    measured = roofline("llama-3.1-8b", tensor=4, all_reduce_table=table_path,
                        all_reduce_kernel="nccl")
    link = roofline("llama-3.1-8b", tensor=4, all_reduce_kernel="nccl")
    table = read_table(table_path, "all_reduce", 4, "t")
    model = MODELS.get("llama-3.1-8b")
    for m in (1, 37, 512, 8192):
        act_bytes = m * model.hidden_size * 2
        link_s = 25e-6 + 2 * 3 / 4 * act_bytes * LINK_S_PER_BYTE
        difference = measured.tables.tokens_s(m) - link.tables.tokens_s(m)
        assert difference == pytest.approx(
            (2 * model.num_layers + 1) * (float(table(np.array(act_bytes))) - link_s),
            rel=1e-9, abs=1e-15)
        assert measured.tables.sampled_s(m) == link.tables.sampled_s(m)


def test_one_gpu_calibrated_roofline_is_unchanged_bit_for_bit():
    """On one GPU the linear layers and the LM head are the fitted GEMMs alone, in the order
    servesim summed them before the vocabulary was split: no communication, no padding (and
    no elementwise kernels: `tests/latency/test_elementwise.py` checks what they add)."""
    for name in ("llama-3.1-8b", "mixtral-8x7b", "tiny"):
        model = MODELS.get(name)
        latency = roofline(name, elementwise="none")
        gemm = GemmModel.for_gpu(H100)
        h, q, kv, i = model.hidden_size, model.q_size, model.kv_size, model.intermediate_size
        for n in (1, 3, 77, 512, 4095):
            m = np.array([float(n)])
            head = gemm.time_s(m, h, model.vocab_size)
            assert latency.tables.sampled_s(n) == float(head[0])
            if model.is_moe:
                continue  # MoE layers: covered by the parallelism tests
            attention = gemm.time_s(m, h, q + 2 * kv) + gemm.time_s(m, q, h)
            expected = model.num_layers * attention
            expected = expected + model.num_dense_layers * (
                gemm.time_s(m, h, 2 * i) + gemm.time_s(m, i, h))
            assert latency.tables.tokens_s(n) == float(expected[0])


def test_one_gpu_roofline_reads_no_communication_table():
    missing = REPO / "no_such_table.csv"  # read only for a split: on one GPU never opened
    plain = roofline("llama-3.1-8b")
    given = roofline("llama-3.1-8b", all_reduce_table=missing, send_recv_table=missing)
    for shape in mixed_shapes(3, 50):
        assert given.iteration_time_s(shape) == plain.iteration_time_s(shape)


def test_an_odd_vocabulary_is_padded_to_64_then_split():
    odd = replace(MODELS.get("tiny"), vocab_size=4097)  # padded to 4160
    assert Parallelism(tensor=2).vocab_rows_per_gpu(odd) == 2080
    assert Parallelism(tensor=1).vocab_rows_per_gpu(odd) == 4160
    latency = RooflineLatency(RooflineConfig(kind="roofline", linear="naive"), odd, H100,
                              Parallelism(tensor=2))
    flops_s, bytes_s = H100.peak_bf16_flops * 0.6, H100.memory_bandwidth_bytes_s * 0.8
    gemm_s = max(2 * 3 * 256 * 2080 / flops_s, 256 * 2080 * 2 / bytes_s)
    gather_s = 25e-6 + 1 / 2 * 3 * 4160 * 2 * LINK_S_PER_BYTE
    assert latency.tables.sampled_s(3) == pytest.approx(gemm_s + gather_s, rel=1e-12)
    described = latency.describe()["communication"]
    assert described["logits_gather"] == "link bandwidth"


def test_a_profile_of_another_split_names_the_scenarios_parallelism():
    """The replica's `parallelism.tensor` is at fault (its value is shown); the profile and the
    split it was measured at are named in the text."""
    profile = REPO / "profiles" / "cpu_tiny.json"  # a one-GPU profile of the tiny model
    config = ProfileConfig(kind="profile", path=profile)
    with pytest.raises(InputError) as exc:
        ProfileLatency(config, MODELS.get("tiny"), H100, parallelism=Parallelism(tensor=2))
    assert (exc.value.field, exc.value.value) == ("parallelism.tensor", 2)
    line = exc.value.one_line()
    assert "\n" not in str(exc.value) and str(profile) in line
    assert "tensor_parallel=1" in line and "--tensor-parallel 2" in line
    moved = exc.value.moved("run.yaml", lambda field: f"replica.{field}")
    assert moved.one_line().startswith("run.yaml: replica.parallelism.tensor=2: ")
    one = ProfileLatency(config, MODELS.get("tiny"), H100, parallelism=SINGLE_GPU)
    assert one.tensor_parallel == 1


def test_the_custom_all_reduce_matches_the_published_h100_timings():
    """vLLM's kernel inside CUDA graphs on H100 (pull requests #24111 and #24532): within
    1.5 us of every published point, one stage or two as vLLM picks them."""
    kernel = CustomAllReduce()
    mib = 2**20
    published = [(2, 0.5 * mib, 7e-6), (4, 0.5 * mib, 17e-6), (4, 1 * mib, 18e-6),
                 (4, 2 * mib, 26e-6), (4, 4 * mib, 42e-6)]
    # At 4 GPUs vLLM takes one stage below 512 KiB (10 us at 0.5 MiB - 1 byte) and two from it.
    assert float(kernel.all_reduce_s(np.array(0.5 * mib - 16), 4)) == pytest.approx(10e-6,
                                                                                    abs=1.5e-6)
    for num_gpus, size, expected_s in published:
        got = float(kernel.all_reduce_s(np.array(size), num_gpus))
        assert got == pytest.approx(expected_s, abs=1.5e-6), (num_gpus, size)


def test_the_custom_all_reduce_leaves_to_nccl_what_vllm_does():
    """Messages from its buffer's size up (8 MiB; 256 KiB over 8 GPUs), other group sizes
    and GPUs without NVLink go to NCCL (the link's ring); an empty message costs nothing."""
    kernel = CustomAllReduce()
    sizes = np.array([0, 4096, 200 * 2**10, 300 * 2**10, 8 * 2**20 - 16, 8 * 2**20])
    four = kernel.all_reduce_s(sizes, 4)
    assert four[0] == 0 and np.isfinite(four[:5]).all() and np.isnan(four[5])
    eight = kernel.all_reduce_s(sizes, 8)
    assert np.isfinite(eight[:3]).all() and np.isnan(eight[3:]).all()
    assert CustomAllReduce.takes_group(4, "nvlink4") and CustomAllReduce.takes_group(2, "nvlink5")
    assert not CustomAllReduce.takes_group(3, "nvlink4")
    assert not CustomAllReduce.takes_group(2, "pcie4")
    # In the roofline: a TP4 decode step pays (2L+1) kernel all-reduces instead of NCCL's.
    custom, nccl = roofline("llama-3.1-8b", tensor=4), roofline("llama-3.1-8b", tensor=4,
                                                                 all_reduce_kernel="nccl")
    model = MODELS.get("llama-3.1-8b")
    for m in (1, 64, 256):
        act = np.array(m * model.hidden_size * 2)
        expected = (2 * model.num_layers + 1) * float(
            kernel.all_reduce_s(act, 4) - nccl.tables.comm.all_reduce(act))
        assert custom.tables.tokens_s(m) - nccl.tables.tokens_s(m) == pytest.approx(
            expected, rel=1e-9)
        assert expected < 0  # the kernel is faster than NCCL's 25 us start-up here
    # 8 MiB and more (a prefill chunk of 512+ tokens of this model) is NCCL in both.
    big = 4096
    assert custom.tables.tokens_s(big) == pytest.approx(nccl.tables.tokens_s(big), rel=1e-12)
