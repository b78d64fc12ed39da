"""SGLang's defaults that depend on the deployment, as SGLang 0.5.23 resolves them: the running
limit from the KV pool and the context window (read from SGLang's own Scheduler by
`tools/golden/check_sglang_defaults.py`, 2026-12-01), and the chunk size by the GPU's memory
(`arg_groups/memory_hook.py`)."""

from __future__ import annotations

import pytest
import yaml

from sim import run_scenario
from sim.config.scenario import parse_scenario
from sim.engine.cluster import make_scheduler, resolved_scheduler
from sim.schedulers import SCHEDULERS
from tests.schedulers.test_sglang_memory import scenario

SGLANG = SCHEDULERS.get("sglang").Config




# (pool tokens, context window, given or 0: unset) -> SGLang 0.5.23's Scheduler's limit.
MEASURED = [((3000, 4096, 0), 1500), ((20_000, 4096, 0), 2500), ((2_000_000, 8192, 0), 4096),
            ((470_000, 131_072, 0), 2048), ((100_000, 32_768, 0), 2048),
            ((300, 4096, 256), 150)]


@pytest.mark.parametrize("case,limit", MEASURED)
def test_the_running_limit_is_the_one_sglang_resolves(case, limit):
    num_tokens, context_len, given = case
    config = SGLANG(name="sglang", **({"max_num_seqs": given} if given else {}))
    assert config.for_kv(num_tokens, context_len).max_num_seqs == limit


def test_speculative_decodings_48_is_capped_by_the_pool_only():
    config = SGLANG(name="sglang", speculative={"algorithm": "ngram", "acceptance_rate": 0.5})
    assert config.max_num_seqs == 48
    assert config.for_kv(470_000, 131_072).max_num_seqs == 48
    assert config.for_kv(60, 4096).max_num_seqs == 30


def test_a_replica_gets_the_limit_of_its_pool():
    # Blocks given: 3,000 one-token pages over Llama-3.1-8B's 131,072-token window.
    s = scenario(kv_cache={"block_size": 1, "num_blocks": 3000})
    assert s.replica.scheduler.max_num_seqs == 256  # (as validated: the pool is not sized yet)
    assert resolved_scheduler(s.replica).max_num_seqs == 1500
    assert make_scheduler(s.replica).config.max_num_seqs == 1500
    # From memory: an H100 holds about 410k tokens of Llama-3.1-8B (SGLang's rule): 2048.
    assert make_scheduler(scenario().replica).config.max_num_seqs == 2048
    # vLLM's limit is not derived from the pool.
    vllm = parse_scenario({**scenario().model_dump(mode="json"),
                           "replica": {"model": "llama-3.1-8b", "scheduler": {
                               "name": "vllm_v1", "max_num_seqs": 300},
                               "kv_cache": {"num_blocks": 100}}}, "t")
    assert make_scheduler(vllm.replica).config.max_num_seqs == 300


def test_the_resolved_scenario_spells_the_limit_out(tmp_path):
    run_scenario(scenario(kv_cache={"block_size": 1, "num_blocks": 3000}), out_dir=tmp_path)
    written = yaml.safe_load((tmp_path / "scenario.yaml").read_text())
    assert written["replica"]["scheduler"]["max_num_seqs"] == 1500
    again = parse_scenario(written, "scenario.yaml")
    assert resolved_scheduler(again.replica).max_num_seqs == 1500


@pytest.mark.parametrize("gpu,size", [
    ("a10g", 4096), ("rtx4090", 4096), ("l40s", 4096), ("a100-80gb", 8192), ("h100-sxm", 8192),
    ("h200", 8192), ("rtxpro6000", 8192), ("b200", 16384), ("mi300x", 16384)])
def test_the_chunk_size_is_sglangs_for_the_gpus_memory(gpu, size):
    assert scenario(gpu).replica.scheduler.chunked_prefill_size == size
    assert scenario(gpu, chunked_prefill_size=512).replica.scheduler.chunked_prefill_size == 512


@pytest.mark.parametrize("model,gpu,speculative,page", [
    ("llama-3.1-8b", "h100-sxm", None, 1), ("llama-3.1-8b", "b200", None, 64),
    ("deepseek-v2-lite", "b200", None, 1), ("llama-3.1-8b", "rtxpro6000", None, 1),
    ("llama-3.1-8b", "b200", {"algorithm": "eagle", "acceptance_rate": 0.7}, 1)])
def test_the_page_is_sglangs_for_the_gpu_and_model(model, gpu, speculative, page):
    """SGLang's page is 1 but on a B200 where TensorRT-LLM's MHA runs (no MLA, no draft
    tree: EAGLE's default for a Llama drafts 4 wide)."""
    data = scenario(gpu).model_dump(mode="json")
    data["replica"] = {"model": model, "gpu": gpu, "scheduler": {
        "name": "sglang", **({"speculative": speculative} if speculative else {})}}
    assert parse_scenario(data, "t").replica.kv_cache.block_size == page
