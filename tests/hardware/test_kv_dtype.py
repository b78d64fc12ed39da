"""`kv_cache.dtype: fp8` (vLLM's --kv-cache-dtype): one byte per KV element, so twice the KV
slots in the same memory, and half the bytes that decode attention reads and that a KV transfer
sends; what cannot predict it refuses it in one line."""

from __future__ import annotations

import pytest

from sim.config.errors import InputError
from sim.config.scenario import parse_scenario
from sim.engine.cluster import kv_cache_for, make_latency
from sim.runner import run_scenario
from tests.helpers import REPO, requires_torch


def replica(**kv: object) -> dict:
    return {"model": "llama-3.1-8b", "gpu": "h100-sxm", "kv_cache": kv}


def scenario(replica_spec: dict, **extra: object):
    data = {"name": "kv", "seed": 0,
            "workload": {"format": "synthetic", "num_requests": 40,
                         "arrivals": {"process": "poisson", "qps": 8},
                         "lengths": {"prompt": {"dist": "fixed", "value": 1000},
                                     "output": {"dist": "fixed", "value": 20}}},
            "replica": replica_spec, **extra}
    return parse_scenario(data, "test")


def test_kv_bytes_per_token_by_hand() -> None:
    auto = scenario(replica()).replica.model_shape
    fp8 = scenario(replica(dtype="fp8")).replica.model_shape
    # Llama-3.1-8B: K and V, 32 layers, 8 KV heads of 128.
    assert auto.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131_072
    assert fp8.kv_bytes_per_token == 2 * 32 * 8 * 128 * 1 == 65_536
    # The weights keep their dtype: only the cache changes.
    assert fp8.weight_bytes == auto.weight_bytes
    # MLA caches its latent and RoPE key: DeepSeek-V2-Lite, 27 layers of 512 + 64.
    mla = scenario({"model": "deepseek-v2-lite", "kv_cache": {"dtype": "fp8_e4m3"}})
    assert mla.replica.model_shape.kv_bytes_per_token == 27 * (512 + 64) * 1


def test_auto_is_the_model_as_registered() -> None:
    cfg = scenario(replica()).replica
    assert cfg.kv_cache.dtype == "auto"
    assert cfg.model_shape.kv_dtype == "auto"
    assert cfg.model_shape.kv_element_bytes == cfg.model_shape.dtype_bytes == 2


def test_fp8_holds_twice_the_blocks_in_the_same_memory() -> None:
    auto, fp8 = (scenario(replica(**kv)).replica for kv in ({}, {"dtype": "fp8"}))
    blocks_auto = kv_cache_for(auto, auto.model_shape).num_blocks
    blocks_fp8 = kv_cache_for(fp8, fp8.model_shape).num_blocks
    # The same free bytes, floored to whole blocks of half the size.
    assert blocks_fp8 in (2 * blocks_auto, 2 * blocks_auto + 1)


def test_roofline_reads_half_the_kv_bytes() -> None:
    auto, fp8 = (scenario(replica(**kv)).replica for kv in ({}, {"dtype": "fp8"}))
    lat_auto = make_latency(auto, auto.model_shape, "test")
    lat_fp8 = make_latency(fp8, fp8.model_shape, "test")
    assert lat_fp8.kv_token_s == lat_auto.kv_token_s / 2
    assert lat_fp8.decode_kv_token_s == max(lat_fp8.attn_pair_s, lat_auto.kv_token_s / 2)
    assert lat_fp8.decode_kv_token_s < lat_auto.decode_kv_token_s


def test_a_transfer_sends_half_the_bytes() -> None:
    """Disaggregated, over a 1 GB/s link with no start-up: every transfer takes half as long."""
    def wire_s(dtype: str) -> list[float]:
        spec = replica(dtype=dtype)
        sc = scenario(spec, cluster={
            "prefill": {"replicas": 1, "replica": spec},
            "decode": {"replicas": 1, "replica": spec},
            "link": {"bandwidth_gb_s": 1.0, "latency_s": 0.0}})
        req = run_scenario(sc).requests
        return (req["transfer_end_s"] - req["transfer_wire_start_s"]).tolist()

    auto, fp8 = wire_s("auto"), wire_s("fp8")
    assert len(auto) == len(fp8) == 40
    # 1,000 prompt tokens of 131,072 bytes at 1e9 bytes/s: 0.131 s; fp8 half of that.
    assert auto == pytest.approx([1000 * 131_072 / 1e9] * 40)
    assert fp8 == pytest.approx([1000 * 65_536 / 1e9] * 40)


def test_pools_must_store_kv_alike() -> None:
    with pytest.raises(InputError, match="must store KV alike: kv_cache.dtype fp8 .prefill. "
                                         "against auto .decode."):
        scenario(replica(), cluster={"prefill": {"replicas": 1, "replica": replica(dtype="fp8")},
                                     "decode": {"replicas": 1, "replica": replica()}})


@pytest.mark.parametrize("dtype", ["fp8", "fp8_e5m2"])
def test_a_profile_refuses_an_fp8_cache(dtype: str) -> None:
    sc = scenario({"model": "tiny", "gpu": "h100-sxm", "kv_cache": {"dtype": dtype},
                   "latency": {"kind": "profile",
                               "path": str(REPO / "profiles" / "cpu_tiny.json")}})
    with pytest.raises(InputError) as info:
        run_scenario(sc)
    assert info.value.problems[0][:2] == ("replica.kv_cache.dtype", dtype)  # the value given
    assert "measured with the KV cache in the model's dtype" in str(info.value)


@requires_torch
def test_replay_refuses_an_fp8_cache() -> None:
    from profiler.replay.serve import check_replayable

    with pytest.raises(InputError, match="replay keeps the KV cache in the model's dtype"):
        check_replayable(scenario(replica(dtype="fp8")))
