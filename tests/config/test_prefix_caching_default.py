"""`replica.prefix_caching` left unset is the engine's default: on for vLLM v1 and SGLang, off
for the generic policies, where the workload names prefixes (hash ids) or a CPU tier is set;
off where nothing could be shared, which for vLLM is the same run until a request is
preempted (its own blocks would stay cached), and then the summary says so."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from sim import run_scenario
from sim.config.scenario import parse_scenario


def _raw(scheduler, workload, **replica):
    return {"name": "pc", "seed": 1, "workload": workload,
            "replica": {"model": "llama-3.1-8b", "gpu": "h100-sxm",
                        "scheduler": scheduler, **replica}}


SHARED = {"format": "prefix", "num_conversations": 40,
          "arrivals": {"process": "poisson", "qps": 8.0},
          "system_prompt_tokens": 1024, "question_tokens": 200, "output_tokens": 40}
UNIQUE = {"format": "synthetic", "num_requests": 60,
          "arrivals": {"process": "poisson", "qps": 8.0},
          "lengths": {"prompt": {"dist": "uniform", "low": 100, "high": 1500},
                      "output": {"dist": "uniform", "low": 10, "high": 200}}}


@pytest.mark.parametrize(("scheduler", "on"), [
    ({"name": "vllm_v1"}, True), ({"name": "sglang"}, True),
    ({"name": "chunked_prefill", "token_budget": 512}, False),
    ({"name": "prefill_first"}, False)])
def test_shared_prefixes_are_cached_where_the_engine_caches_them(tmp_path, scheduler, on):
    """A shared system prompt: vLLM v1 and SGLang cache it as their servers do by default,
    and the resolved scenario written beside the results says so; an explicit false wins."""
    res = run_scenario(parse_scenario(_raw(scheduler, SHARED), "<test>"), out_dir=tmp_path / "a")
    written = yaml.safe_load((tmp_path / "a" / "scenario.yaml").read_text())
    assert written["replica"]["prefix_caching"] is on
    assert ("prefix_cache" in res.summary) is on
    if on:
        assert res.summary["prefix_cache"]["hit_rate_tokens"] > 0.5
        off = run_scenario(parse_scenario(_raw(scheduler, SHARED, prefix_caching=False),
                                          "<test>"))
        assert "prefix_cache" not in off.summary
        assert off.summary["ttft_s"]["p50"] > res.summary["ttft_s"]["p50"]


@pytest.mark.parametrize("name", ["vllm_v1", "sglang"])
def test_without_hash_ids_caching_is_left_off_and_changes_nothing(tmp_path, name):
    """Nothing to share: caching is left off (faster), and the run is the one with caching
    on, request for request (no request was preempted, so none could hit its own blocks)."""
    res = run_scenario(parse_scenario(_raw({"name": name}, UNIQUE), "<test>"),
                       out_dir=tmp_path / "a")
    written = yaml.safe_load((tmp_path / "a" / "scenario.yaml").read_text())
    assert written["replica"]["prefix_caching"] is False
    on = run_scenario(parse_scenario(_raw({"name": name}, UNIQUE, prefix_caching=True),
                                     "<test>"))
    assert res.requests["num_preemptions"].sum() == 0
    for column in ("ttft_s", "e2e_s", "num_generated_tokens"):
        np.testing.assert_array_equal(res.requests[column], on.requests[column])
    assert "prefix_caching_left_off" not in res.summary["run"]


def test_preemptions_with_caching_left_off_are_said(tmp_path):
    """A KV cache too small for the load: requests are preempted, and vLLM's default prefix
    cache would have kept their own blocks for their return (fewer tokens computed again), so
    a run that left caching off for want of hash ids says so; one that chose it does not."""
    tight = {"kv_cache": {"num_blocks": 200}}
    workload = {**UNIQUE, "arrivals": {"process": "poisson", "qps": 40.0}}
    left = run_scenario(parse_scenario(_raw({"name": "vllm_v1"}, workload, **tight),
                                       "<test>"))
    num = int(left.requests["num_preemptions"].sum())
    assert num > 0
    note = left.summary["run"]["prefix_caching_left_off"]
    assert note.startswith("replica.prefix_caching left off") and f"{num:,} preemptions" in note
    chosen = run_scenario(parse_scenario(
        _raw({"name": "vllm_v1"}, workload, prefix_caching=False, **tight), "<test>"))
    assert "prefix_caching_left_off" not in chosen.summary["run"]
    cached = run_scenario(parse_scenario(
        _raw({"name": "vllm_v1"}, workload, prefix_caching=True, **tight), "<test>"))
    # Their own blocks found again on their return: fewer prompt tokens computed. (Not in
    # the hit rate, which counts each request's first lookup, as vLLM's `num_cached_tokens`.)
    assert (cached.iterations["num_prefill_tokens"].sum()
            < left.iterations["num_prefill_tokens"].sum())
    assert (cached.requests["num_preemptions"] > 0).any()


def test_a_cpu_tier_turns_the_default_on_without_hash_ids():
    """vLLM's CPU tier keys blocks by prefix: with `kv_offload` and `prefix_caching` unset,
    caching is on (as vLLM runs it), not refused."""
    raw = _raw({"name": "vllm_v1", "engine_version": "0.15.1"}, UNIQUE,
               kv_offload={"size_gib": 1.0})
    res = run_scenario(parse_scenario(raw, "<test>"))
    assert "prefix_cache" in res.summary and "kv_offload" in res.summary


def test_sglang_near_a_full_kv_cache_with_caching_left_off_is_said():
    """SGLang's admission check with its radix cache (its default) differs from the one
    without near a full KV cache: a run that left caching off for want of hash ids and came
    near full says so; one far from full, or that chose, does not."""
    tight = {"kv_cache": {"num_blocks": 200}}
    workload = {**UNIQUE, "arrivals": {"process": "poisson", "qps": 40.0}}
    left = run_scenario(parse_scenario(_raw({"name": "sglang"}, workload, **tight), "<test>"))
    full = max(r["max_kv_utilization"] for r in left.summary["replicas"])
    assert full >= 0.9
    assert "KV use up to" in left.summary["run"]["prefix_caching_left_off"]
    chosen = run_scenario(parse_scenario(
        _raw({"name": "sglang"}, workload, prefix_caching=False, **tight), "<test>"))
    assert "prefix_caching_left_off" not in chosen.summary["run"]
    roomy = run_scenario(parse_scenario(_raw({"name": "sglang"}, UNIQUE), "<test>"))
    assert max(r["max_kv_utilization"] for r in roomy.summary["replicas"]) < 0.9
    assert "prefix_caching_left_off" not in roomy.summary["run"]
