"""Speculative decoding on disaggregated pools, exactly, on a constant step: the decode
replicas verify drafts (vLLM's from the second step there, SGLang's from the first, with its KV
top-up); a prefill replica configured with a drafter holds vLLM's lookahead slots and samples
only the first token; a decode replica whose SGLang top-up outgrows its pool aborts the request
and admits the transfer waiting behind it at once."""

from __future__ import annotations

from typing import Any

import pytest

from sim import run_scenario
from sim.config.scenario import parse_scenario
from tests.helpers import TICK, disaggregated


def pool(scheduler: dict[str, Any], num_blocks: int = 1000, block_size: int = 1
         ) -> dict[str, Any]:
    return {"model": "tiny", "scheduler": scheduler,
            "latency": {"kind": "constant", "iteration_s": TICK},
            "kv_cache": {"block_size": block_size, "num_blocks": num_blocks}}


VLLM = {"name": "vllm_v1", "async_scheduling": False,
        "speculative": {"method": "eagle", "num_speculative_tokens": 2, "acceptance_rate": 1.0,
                        "draft_time_ratio": 0.0}}
SGLANG = {"name": "sglang", "overlap_schedule": False,
          "speculative": {"algorithm": "eagle", "num_steps": 3, "eagle_topk": 1,
                          "num_draft_tokens": 4, "acceptance_rate": 1.0,
                          "draft_time_ratio": 0.0}}
FAST_LINK = {"bandwidth_gb_s": 1e6, "latency_s": 0.0}


def by_pool(res, name: str):
    it = res.iterations
    return it[it["pool"] == name]


@pytest.mark.parametrize(("version", "blocks"), [("0.15.1", 1), ("0.33.0", 2)])
def test_vllm_decode_pool_drafts_from_its_second_step(tmp_path, version, blocks):
    """The request joins the decode replica with its prompt's KV, and no drafts: its first
    step there computes the prompt's last token again and samples the first token (vLLM's
    prefill answer is dropped: its TTFT is this step's end), proposing 2, and every later step
    verifies them (all accepted: 3 tokens a step): 1 + 3 + 3 + 1 = 8. The prefill replica,
    with the same drafter configured, computes the prompt only; vLLM 0.33.0 allocates the
    drafter's 2 lookahead slots with the prompt (18 tokens: 2 blocks of 16), 0.15.1 none at
    admission."""
    prefill = pool({**VLLM, "engine_version": version}, block_size=16)
    res = run_scenario(disaggregated(tmp_path, [(0.0, 16, 8)], prefill=prefill,
                                     decode=pool(VLLM), link=FAST_LINK))
    pre, dec = by_pool(res, "prefill"), by_pool(res, "decode")
    assert pre["num_prefill_tokens"].tolist() == [16]
    assert pre["num_kv_blocks_used"].tolist() == [blocks]
    assert dec["num_prefill_tokens"].tolist() == [1, 0, 0, 0]
    assert dec["num_decode_tokens"].tolist() == [0, 1, 1, 1]
    assert dec["num_spec_tokens"].tolist() == [0, 2, 2, 2]
    req = res.requests.iloc[0]
    assert req["status"] == "finished" and req["num_generated_tokens"] == 8
    assert (req["num_drafts_verified"], req["num_drafts_accepted"]) == (6, 6)
    first_decode_end = float(dec["start_s"].iloc[0] + dec["duration_s"].iloc[0])
    assert req["ttft_s"] == pytest.approx(first_decode_end - req["arrival_s"])
    assert req["prefill_end_s"] < req["first_token_s"]
    assert res.summary["speculative"]["num_speculative_tokens"] == 2


def test_sglang_decode_pool_verifies_and_tops_up_from_its_first_step(tmp_path):
    """SGLang's decode replica verifies D = 4 tokens at every step, the first one included
    (its prefill server sends the draft's state with the KV), each step topping the request up
    to its committed KV plus 2L = 8 slots: 100 + 8, 104 + 8, 108 + 8; 1 + 4 + 4 + 4 = 13."""
    res = run_scenario(disaggregated(tmp_path, [(0.0, 100, 13)], prefill=pool(SGLANG),
                                     decode=pool(SGLANG), link=FAST_LINK))
    dec = by_pool(res, "decode")
    assert dec["num_spec_tokens"].tolist() == [3, 3, 3]
    assert dec["num_kv_blocks_used"].tolist() == [108, 112, 116]
    assert dec["duration_s"].tolist() == pytest.approx([TICK] * 3)
    assert res.requests.iloc[0]["num_generated_tokens"] == 13
    assert res.summary["speculative"]["engine"] == "sglang"


def test_sglang_decode_pool_abort_admits_the_waiting_transfer_at_once(tmp_path):
    """A (100 tokens, 18 out) holds 100 of the decode replica's 122 slots, then its top-ups
    (108, 112, 116, 120), so B (30) waits for room, before its prefill (SGLang's decode
    server preallocates first). At A's fifth step its top-up (116 + 8) outgrows the pool:
    SGLang aborts it, the last of its batch, and the decode loop admits B on the KV freed at
    that instant (it would otherwise wait for an arrival that never comes); B's prefill runs
    then. (The decode server keeps no tokens back per request here, so that A fits.)"""
    decode = pool({**SGLANG, "num_reserved_decode_tokens": 0}, num_blocks=122)
    res = run_scenario(disaggregated(tmp_path, [(0.0, 100, 18), (0.0, 30, 5)],
                                     prefill=pool(SGLANG), decode=decode, link=FAST_LINK))
    req = res.requests.set_index("request_id")
    assert req.loc[0, "status"] == "failed" and req.loc[0, "reason"].startswith("kv_oom")
    assert req.loc[1, "status"] == "finished"
    dec = by_pool(res, "decode")
    assert dec["num_kv_blocks_used"].tolist()[:4] == [108, 112, 116, 120]
    # (Times are a link's 1e-10 s late: the prompt's KV crosses it.)
    assert req.loc[0, "failed_s"] == pytest.approx(5 * TICK)
    assert req.loc[1, "first_scheduled_s"] == pytest.approx(5 * TICK)  # admitted: prefilled
    assert req.loc[1, "transfer_end_s"] == pytest.approx(6 * TICK)  # in at once
    assert dec["start_s"].tolist()[4] == pytest.approx(6 * TICK)  # B's first step


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_vllm_prefill_replica_runs_its_drafter_after_the_first_token(tmp_path,
                                                                      async_scheduling):
    """vLLM's model runner proposes after every step that sampled, a prefill instance's too
    (`propose_draft_token_ids`, no kv-producer exception): the prefill step takes the target's
    pass, the drafter's over the prompt and its 2 passes over the sampled request, at half the
    target's time each: 1 + 0.5 + 2 x 0.5 = 2.5 steps, synchronous or async alike."""
    drafter = {**VLLM, "async_scheduling": async_scheduling,
               "speculative": {**VLLM["speculative"], "draft_time_ratio": 0.5}}
    res = run_scenario(disaggregated(tmp_path, [(0.0, 16, 4)], prefill=pool(drafter),
                                     decode=pool(VLLM), link=FAST_LINK))
    assert by_pool(res, "prefill")["duration_s"].tolist() == pytest.approx([2.5 * TICK])


def _prefix_pair(replica: dict[str, Any], **extra: Any):
    """Two 41-token prompts of one 40-token system prompt on 1 prefill + 1 decode replica,
    the second arriving at 1.02 s."""
    return parse_scenario({
        "seed": 0, "record_token_times": True, **extra,
        "workload": {"format": "prefix", "num_requests": 2, "num_conversations": 2,
                     "num_groups": 1, "system_prompt_tokens": 40, "hash_block_tokens": 4,
                     "question_tokens": {"dist": "uniform", "low": 1, "high": 1},
                     "output_tokens": {"dist": "uniform", "low": 4, "high": 4},
                     "arrivals": {"process": "gamma", "qps": 1.0, "cv": 1.0}},
        "cluster": {"prefill": {"replicas": 1, "replica": replica},
                    "decode": {"replicas": 1, "replica": replica}, "link": FAST_LINK}},
        "test")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_vllm_033_prefill_replica_rejects_the_padding_of_a_prefix_hit(async_scheduling):
    """vLLM 0.33.0 pads a prompt whose prefix hit leaves one token with k drafts that cannot
    be accepted, on a prefill instance too: the second request (its 40-token system prompt
    cached, 1 token its own) computes 1 + 2 tokens there, rejects the padding, samples its
    first token and is handed off, as the first one was (before, it stayed running, computed
    past its prompt, and the replica stalled)."""
    replica = {**pool({**VLLM, "engine_version": "0.33.0",
                       "async_scheduling": async_scheduling}), "prefix_caching": True}
    res = run_scenario(_prefix_pair(replica))
    assert res.requests["status"].tolist() == ["finished", "finished"]
    assert res.requests["num_generated_tokens"].tolist() == [4, 4]
    assert by_pool(res, "prefill")["num_prefill_tokens"].tolist() == [41, 3]
    assert res.requests["prefill_end_s"].notna().all()


@pytest.mark.parametrize("fast_forward", [True, False])
def test_a_padded_prefill_step_cut_by_the_horizon_keeps_the_prefix_hit(fast_forward):
    """The async prefill replica's padded step (1 + 2 tokens, the padding dropped when it is
    sent) is still in flight at the horizon: taken back, the second request is left with its
    40-token prefix hit computed, not 2 fewer."""
    replica = {**pool({**VLLM, "engine_version": "0.33.0", "async_scheduling": True}),
               "prefix_caching": True}
    res = run_scenario(_prefix_pair(replica, horizon_s=1.025), fast_forward=fast_forward)
    second = res.requests.iloc[1]
    assert second["status"] == "unfinished"
    assert second["num_cached_tokens"] == second["num_computed_tokens"] == 40


def test_stale_tokens_delivered_to_a_request_admitted_again_leave_it_prefilling():
    """Found by a fuzzer (vLLM 0.33.0, async EAGLE decode pool, block size 1, two-turn
    conversations): a decode request preempted with a step in flight is admitted again at
    once, its prefix hit leaving one token (padded); the stale step's token then joins its
    output, so it has two tokens to compute, not one: it must be among the running requests
    with tokens left (`ReplicaState.prefilling`). Every invariant is checked after each plan
    (before, one failed here), stepped and fast alike."""
    from sim.schedulers.base import checks
    from tests.engine.fastpath_helpers import assert_same_results

    def replica(scheduler):
        return {"scheduler": {"name": "vllm_v1", "engine_version": "0.33.0", **scheduler},
                "latency": {"kind": "constant", "iteration_s": 0.01}, "prefix_caching": True}

    prefill = {**replica({"max_num_batched_tokens": 1024, "max_num_seqs": 4,
                          "enable_chunked_prefill": False, "async_scheduling": False,
                          "speculative": {"method": "ngram", "num_speculative_tokens": 2,
                                          "acceptance_rate": 0.8, "draft_time_ratio": 0.0}}),
               "kv_cache": {"block_size": 1, "num_blocks": 684}}
    decode = {**replica({"max_num_batched_tokens": 256, "max_num_seqs": 64,
                         "async_scheduling": True,
                         "speculative": {"method": "eagle", "num_speculative_tokens": 3,
                                         "acceptance_rate": 0.8, "draft_time_ratio": 0.1}}),
              "kv_cache": {"block_size": 1, "num_blocks": 1164}}
    scenario = parse_scenario({
        "seed": 38579, "record_token_times": True,
        "workload": {"format": "prefix", "num_requests": 31, "num_conversations": 31,
                     "num_groups": 1, "system_prompt_tokens": 100, "hash_block_tokens": 1,
                     "question_tokens": {"dist": "uniform", "low": 1, "high": 23},
                     "output_tokens": {"dist": "uniform", "low": 1, "high": 35},
                     "arrivals": {"process": "gamma", "qps": 196.3, "cv": 3.26},
                     "num_turns": 2, "think_time_s": 1.0},
        "cluster": {"prefill": {"replicas": 2, "replica": prefill},
                    "decode": {"replicas": 1, "replica": decode},
                    "link": {"bandwidth_gb_s": 0.1, "latency_s": 0.0}, "overlap_transfer": True,
                    "router": {"name": "round_robin"},
                    "decode_router": {"name": "least_outstanding"}}}, "test")
    before = checks(True)
    try:
        fast, slow = run_scenario(scenario), run_scenario(scenario, fast_forward=False)
    finally:
        checks(before)
    assert_same_results(fast, slow)
    assert (fast.requests["status"] == "finished").all()
    assert fast.requests["num_preemptions"].sum() > 0
