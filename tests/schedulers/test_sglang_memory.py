"""An `sglang` replica's KV pool as SGLang 0.5.23 sizes it (`sim.schedulers.sglang_memory`):
`--mem-fraction-static` derived from the GPU's memory, the chunk, the decode CUDA graphs and
TP x PP (the numbers SGLang's own server-argument resolution printed,
`tools/golden/check_sglang_memory.py`, 2026-12-01), then the pool that fraction leaves after
the weights."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from sim import run_scenario
from sim.cli.listing import parameter_rows
from sim.config.errors import InputError
from sim.config.replica import ReplicaConfig
from sim.config.scenario import parse_scenario
from sim.engine.cluster import (
    kv_cache_for,
    make_scheduler,
    num_kv_blocks,
    resolved_scheduler,
    sglang_mem_fraction,
)
from sim.hardware.gpus import GPUS
from sim.schedulers import SCHEDULERS
from sim.schedulers.sglang_memory import MemoryInputs, default_mem_fraction_static

MiB = 2**20


def scenario(gpu: str = "h100-sxm", kv_cache: dict | None = None, replica: dict | None = None,
             **scheduler) -> object:
    data = {"name": "d", "workload": {"format": "synthetic", "num_requests": 4,
                                      "arrivals": {"process": "poisson", "qps": 1.0},
                                      "lengths": {"prompt": {"dist": "fixed", "value": 8},
                                                  "output": {"dist": "fixed", "value": 2}}},
            "replica": {"model": "llama-3.1-8b", "gpu": gpu,
                        "scheduler": {"name": "sglang", **scheduler},
                        **({"kv_cache": kv_cache} if kv_cache else {}), **(replica or {})}}
    return parse_scenario(data, "t")


def tokens(cfg: ReplicaConfig, role: str = "colocated") -> int:
    return num_kv_blocks(cfg, cfg.model_shape, 0, role) * cfg.kv_cache.block_size


# (nvidia-smi MiB, TP, PP, more server arguments) -> what SGLang 0.5.23 resolved, for a
# Llama-3.1-8B-shaped model (`tools/golden/check_sglang_memory.py`).
MEASURED = [
    ((81_559, 1, 1, {}), 0.83), ((81_559, 4, 1, {}), 0.819), ((81_559, 1, 2, {}), 0.834),
    ((81_559, 1, 1, {"max_running_requests": 64}), 0.834),
    ((81_559, 1, 1, {"chunked_prefill_size": 16384}), 0.677),
    ((143_771, 1, 1, {}), 0.903), ((143_771, 8, 1, {}), 0.893), ((81_920, 2, 1, {}), 0.829),
    ((46_068, 1, 1, {}), 0.843), ((24_564, 1, 1, {}), 0.704), ((23_028, 4, 1, {}), 0.657),
    ((183_359, 1, 1, {}), 0.854), ((97_887, 1, 1, {}), 0.858),
    ((81_559, 1, 1, {"disaggregation_mode": "prefill"}), 0.836),
    ((81_559, 1, 1, {"disaggregation_mode": "decode"}), 0.874),
    # DP attention (2026-12-03): SGLang's --tp is every rank's GPUs; its decode graphs
    # reserve max_bs x ranks x 3 MiB more (x 4.5 above 300).
    ((143_771, 8, 1, {"enable_dp_attention": True, "dp_size": 8}), 0.765),
    ((81_559, 4, 1, {"enable_dp_attention": True, "dp_size": 4}), 0.706),
    ((81_559, 8, 1, {"enable_dp_attention": True, "dp_size": 8, "max_running_requests": 64}),
     0.804),
    ((143_771, 8, 1, {"enable_dp_attention": True, "dp_size": 8,
                      "disaggregation_mode": "decode"}), 0.833),
    ((143_771, 8, 1, {"enable_dp_attention": True, "dp_size": 8,
                      "disaggregation_mode": "prefill"}), 0.901),
    ((143_771, 8, 1, {"enable_dp_attention": True, "dp_size": 2}), 0.861)]


@pytest.mark.parametrize("case,fraction", MEASURED)
def test_the_fraction_is_the_one_sglang_resolves(case, fraction):
    mib, tp, pp, extra = case
    gpu = dataclasses.replace(GPUS.get("h100-sxm"), name="custom", memory_bytes=mib * MiB)
    chunk = 4096 if mib < 60 * 1024 else 8192 if mib < 160 * 1024 else 16384
    inputs = MemoryInputs(
        gpu=gpu, tensor=tp, pipeline=pp,
        chunked_prefill_size=extra.get("chunked_prefill_size", chunk),
        max_running_requests=extra.get("max_running_requests"), num_draft_tokens=None,
        mla=False, llama2=False, context_len=131_072,
        role=extra.get("disaggregation_mode", "colocated"),
        num_dp_ranks=extra.get("dp_size", 1))
    assert default_mem_fraction_static(inputs) == fraction


def test_an_h100s_pool_of_llama_8b_by_hand():
    """reserved = 512 + 1.5 x 8192 + 1/8 x 1024 + 2 x 256 (decode graphs) + 8 x 58 (prefill
    graphs up to 8192 tokens) = 13,904 MiB of nvidia-smi's 81,559: 0.830. Free before the
    weights 81,559 - 1,247 = 80,312 MiB; x 0.83 = 66,658.96 MiB, less 16,060,522,496 bytes of
    weights (15,316.52 MiB), over 128 KiB a token (8 KV heads x 128 x 2 x 32 layers x 2 bytes):
    410,739 tokens, 9.1% fewer than vLLM's 452,032."""
    s = scenario()
    assert sglang_mem_fraction(s.replica) == 0.83
    assert tokens(s.replica) == 410_739
    vllm = scenario(replica={"scheduler": {"name": "vllm_v1"}})
    assert tokens(vllm.replica) == 452_032
    assert kv_cache_for(s.replica, s.replica.model_shape).num_blocks == 410_739
    assert make_scheduler(s.replica).config.max_num_seqs == 2048  # 410,739 / 131,072 x 512


def test_an_h200s_pool_of_llama_8b_by_hand():
    """The same 13,904 MiB of 143,771: 0.903; (142,524 x 0.903 - 15,316.52) MiB / 128 KiB."""
    s = scenario("h200")
    assert sglang_mem_fraction(s.replica) == 0.903
    assert tokens(s.replica) == 907_061
    assert make_scheduler(s.replica).config.max_num_seqs == 3543  # 907,061 / 131,072 x 512


def test_llama_70b_at_tp4_by_hand():
    """TP4: decode graphs up to 512 (2 x 512) and 4/8 GiB for the group: 14,800 MiB reserved,
    0.819; each GPU 35,278,831,616 bytes of weights (33,644.5 MiB) and 80 KiB a token (2 KV
    heads): (80,312 x 0.819 - 33,644.5) MiB / 80 KiB = 411,276."""
    s = scenario(replica={"model": "llama-3.1-70b", "parallelism": {"tensor": 4}})
    assert sglang_mem_fraction(s.replica) == 0.819
    assert tokens(s.replica) == 411_276


def test_amds_aiter_takes_15_percent_more_beyond_8k_tokens():
    # 196,288 MiB: 16384-token chunks, 512 decode graphs, no prefill graphs (ROCm):
    # 512 + 24,576 + 128 + 1,024 = 26,240 MiB reserved, 0.866; x 0.85 past 8192 tokens.
    assert sglang_mem_fraction(scenario("mi300x").replica) == pytest.approx(0.866 * 0.85)
    short = scenario("mi300x", replica={"max_model_len": 8192})
    assert sglang_mem_fraction(short.replica) == 0.866


def test_each_pool_of_a_disaggregated_cluster_has_its_own():
    s = scenario()
    assert resolved_scheduler(s.replica, "prefill").mem_fraction_static == 0.836
    assert resolved_scheduler(s.replica, "decode").mem_fraction_static == 0.874
    assert tokens(s.replica, "decode") > tokens(s.replica) > 0


def test_a_given_fraction_is_used_as_given():
    # (80,312 x 0.5 - 15,316.52) MiB / 128 KiB = 198,715.9
    s = scenario(mem_fraction_static=0.5)
    assert tokens(s.replica) == 198_715
    assert resolved_scheduler(s.replica).mem_fraction_static == 0.5


def test_the_resolved_scenario_spells_the_fraction_out(tmp_path):
    run_scenario(scenario(), out_dir=tmp_path)
    written = yaml.safe_load((tmp_path / "scenario.yaml").read_text())
    assert written["replica"]["scheduler"]["mem_fraction_static"] == 0.83
    assert written["replica"]["scheduler"]["max_num_seqs"] == 2048
    again = parse_scenario(written, "scenario.yaml")
    assert tokens(again.replica) == 410_739


def test_blocks_given_take_no_fraction(tmp_path):
    s = scenario(kv_cache={"block_size": 1, "num_blocks": 3000})
    assert sglang_mem_fraction(s.replica) is None
    assert resolved_scheduler(s.replica).mem_fraction_static is None
    with pytest.raises(InputError, match="mem_fraction_static=0.8: has no effect when "
                                         "kv_cache.num_blocks is given"):
        scenario(kv_cache={"num_blocks": 3000}, mem_fraction_static=0.8)


@pytest.mark.parametrize("field,value", [("gpu_memory_utilization", 0.8),
                                         ("activation_reserve_gb", 4.0)])
def test_vllms_memory_settings_are_refused_on_sglang(field, value):
    with pytest.raises(InputError) as err:
        scenario(kv_cache={field: value})
    line = err.value.one_line()
    assert f"replica.kv_cache.{field}={value}" in line
    assert "give scheduler.mem_fraction_static" in line
    assert "\n" not in line
    scenario(replica={"scheduler": {"name": "vllm_v1"}}, kv_cache={field: value})  # vLLM's own


def test_no_room_names_sglangs_fraction():
    s = scenario(replica={"model": "llama-3.1-70b"})
    with pytest.raises(InputError, match="scheduler.mem_fraction_static 0.83"):
        kv_cache_for(s.replica, s.replica.model_shape)


def test_the_listing_says_the_fraction_is_derived():
    rows = parameter_rows(SCHEDULERS.get("sglang").Config)
    assert rows["mem_fraction_static"][0].startswith("derived")
