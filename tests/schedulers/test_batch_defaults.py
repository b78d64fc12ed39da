"""vLLM's server defaults of `max_num_batched_tokens` and `max_num_seqs` by GPU and release
(`EngineArgs.get_batch_defaults`), what `vllm_v1` takes where a scenario leaves them unset;
without chunking the budget is at least the context window."""

from __future__ import annotations

import pytest

from sim.config.errors import InputError
from sim.config.scenario import parse_scenario
from tests.helpers import assert_one_line_error, run_cli


def replica(gpu: str, version: str = "0.15.1", **scheduler) -> object:
    data = {"name": "d", "workload": {"format": "synthetic", "num_requests": 1,
                                      "arrivals": {"process": "poisson", "qps": 1.0},
                                      "lengths": {"prompt": {"dist": "fixed", "value": 8},
                                                  "output": {"dist": "fixed", "value": 2}}},
            "replica": {"model": "llama-3.1-8b", "gpu": gpu,
                        "scheduler": {"name": "vllm_v1", "engine_version": version,
                                      **scheduler}}}
    return parse_scenario(data, "t").replica.scheduler


@pytest.mark.parametrize("gpu,version,budget,seqs", [
    ("h100-sxm", "0.15.1", 8192, 1024), ("h200", "0.15.1", 8192, 1024),
    ("a100-80gb", "0.15.1", 2048, 256), ("l40s", "0.15.1", 2048, 256),
    ("rtx4090", "0.15.1", 2048, 256), ("rtxpro6000", "0.15.1", 8192, 1024),
    ("b200", "0.15.1", 8192, 1024), ("b200", "0.33.0", 16384, 1024),
    ("mi300x", "0.33.0", 16384, 1024), ("h100-sxm", "0.33.0", 8192, 1024),
])
def test_the_defaults_are_vllms_for_the_gpu(gpu, version, budget, seqs):
    s = replica(gpu, version)
    assert (s.max_num_batched_tokens, s.max_num_seqs) == (budget, seqs)


def test_given_values_and_chunking_off():
    assert replica("l40s", max_num_batched_tokens=512).max_num_seqs == 256
    assert replica("h100-sxm", max_num_batched_tokens=512).max_num_seqs == 512
    assert replica("h100-sxm", max_num_seqs=8).max_num_batched_tokens == 8192
    # Without chunking, at least the context window (Llama-3.1-8B: 131,072 tokens).
    assert replica("l40s", enable_chunked_prefill=False).max_num_batched_tokens == 131072


def test_a_bad_engine_version_is_one_line(tmp_path, monkeypatch, capsys):
    path = tmp_path / "s.yaml"
    path.write_text("workload: {format: synthetic, num_requests: 1, arrivals: {qps: 1.0}, "
                    "lengths: {prompt: {dist: fixed, value: 8}, output: {dist: fixed, value: 2}}}"
                    "\nreplica: {scheduler: {name: vllm_v1, engine_version: [1]}}\n")
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path))
    assert_one_line_error(code, err, "engine_version", "unknown vLLM version")


@pytest.mark.parametrize("model,gpu,version,block_size", [
    ("deepseek-v2-lite", "h100-sxm", "0.15.1", 64), ("deepseek-v2-lite", "h200", "0.15.1", 64),
    ("deepseek-v2-lite", "b200", "0.15.1", 64), ("deepseek-v2-lite", "a100-80gb", "0.15.1", 16),
    ("deepseek-v2-lite", "h100-sxm", "0.33.0", 16), ("deepseek-v2-lite", "b200", "0.33.0", 32),
    ("llama-3.1-8b", "h100-sxm", "0.15.1", 16), ("llama-3.1-8b", "b200", "0.33.0", 16)])
def test_the_block_size_is_the_one_vllms_attention_backend_takes(model, gpu, version,
                                                                 block_size):
    """DeepSeek's latent attention runs on FlashMLA (0.15.1 on Hopper: blocks of 64) or
    FlashInfer MLA (B200: 64 in 0.15.1, its smallest, 32, in 0.33.0); given, a size stays."""
    def kv(**given):
        data = {"name": "d", "workload": {"format": "synthetic", "num_requests": 1,
                                          "arrivals": {"process": "poisson", "qps": 1.0},
                                          "lengths": {"prompt": {"dist": "fixed", "value": 8},
                                                      "output": {"dist": "fixed", "value": 2}}},
                "replica": {"model": model, "gpu": gpu, "kv_cache": given,
                            "scheduler": {"name": "vllm_v1", "engine_version": version}}}
        return parse_scenario(data, "t").replica.kv_cache
    assert kv().block_size == block_size
    assert kv(block_size=128).block_size == 128
    if (version, block_size) == ("0.15.1", 64):  # a size it would replace: refused, one line
        with pytest.raises(InputError, match=r"replica.kv_cache.block_size=16: vLLM 0.15.1 "
                                             r"runs DeepSeek's latent attention"):
            kv(block_size=16)
    else:
        assert kv(block_size=16).block_size == 16
