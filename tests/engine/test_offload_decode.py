"""vLLM's CPU tier on a disaggregated cluster's decode pool (`cluster.decode.replica.kv_offload`:
the offloading connector beside the KV-transfer one, a `MultiConnector`): the prompt blocks a
transfer brings are stored at the request's first step there, a request preempted there loads
them back, times worked out by hand on the constant latency model; what it refuses."""

from __future__ import annotations

import pytest

from sim.config.errors import InputError
from sim.config.scenario import parse_scenario
from sim.core.request import Request, Status
from sim.engine.cluster import Cluster
from tests.engine.test_offload import BLOCK_BYTES, _host_states

STEP_S = 0.01


def _decode_with_tier(version: str, horizon_s: float | None, num_decode_blocks: int = 9,
                      **decode_scheduler) -> Cluster:
    """One prefill replica and one decode replica with a CPU tier of 16 blocks (vLLM, sync
    engine, 10 ms a step, a block stored or loaded in 1 ms); a 16-token block's KV crosses
    the link in 0.5 ms (a 64-token prompt's in 2 ms)."""
    return Cluster(parse_scenario(_data(version, horizon_s, num_decode_blocks, **decode_scheduler),
                                  "<test>"), fast_forward=False)


def _data(version: str, horizon_s: float | None, num_decode_blocks: int = 9,
          **decode_scheduler) -> dict:
    sync = {"name": "vllm_v1", "async_scheduling": False, "engine_version": version}
    plain = {"scheduler": sync, "latency": {"kind": "constant", "iteration_s": STEP_S},
             "prefix_caching": True, "kv_cache": {"block_size": 16, "num_blocks": 9}}
    decode = {**plain, "scheduler": {**sync, **decode_scheduler},
              "kv_cache": {"block_size": 16, "num_blocks": num_decode_blocks},
              "kv_offload": {"size_gib": 16 * BLOCK_BYTES / 2**30,
                             "host_bandwidth_gb_s": BLOCK_BYTES / 1e-3 / 1e9}}
    return {
        "name": "pd_decode_offload", "seed": 0, "horizon_s": horizon_s,
        "workload": {"format": "synthetic", "num_requests": 1,
                     "arrivals": {"process": "poisson", "qps": 1.0},
                     "lengths": {"prompt": {"dist": "fixed", "value": 1},
                                 "output": {"dist": "fixed", "value": 1}}},
        "cluster": {"prefill": {"replicas": 1, "replica": plain},
                    "decode": {"replicas": 1, "replica": decode},
                    "link": {"bandwidth_gb_s": BLOCK_BYTES / 0.5e-3 / 1e9,
                             "latency_s": 0.0}}}


@pytest.mark.parametrize("version", ["0.15.1", "0.33.0"])
def test_a_decode_replica_stores_the_prompt_blocks_a_transfer_brought(version):
    """A (64-token prompt, 4 blocks, 3 tokens out) is prefilled 0-10 ms; the decode replica
    allocates its 4 blocks at 10 ms and its KV crosses 10-12 ms. There vLLM's queue asks both
    connectors: the tier is looked up (1 lookup, nothing held) but the transfer connector,
    first, claims the request. At 12 ms A's first step computes the prompt's last token again
    (12-22 ms): its 4 full prompt blocks are the connector's to store, from block 0 (0.15.1's
    `_next_stored_block_idx` has no entry for it; 0.33.0's lookup set its next block to 0).
    They are copied from the next launch: 22-26 ms, 1 ms a block. Tokens at 22, 32, 42 ms.
    Looked at 35 ms, no host block is loadable yet: 0.15.1 completes the stores only once A
    is reported finished sending (after it finishes); 0.33.0's poll at the 32 ms launch found
    the jobs done, but the scheduler takes that report with the step's output, at 42 ms. A
    finishes at 42 ms; 0.15.1 holds its 5 GPU blocks (token 65's too) until the poll of the
    empty step launched then (to tell the worker A finished) finds its stores done, and
    frees them at once; none are held at the end, the 4 host blocks loadable."""
    cluster = _decode_with_tier(version, 0.035)
    a = Request(0, 0.0, 64, 3, hash_ids=(1, 2, 3, 4), hash_block_tokens=16)
    cluster.run([a])
    decode = cluster.replicas[1]
    tier = decode.state.offload.tier
    assert a.transfer_end_s == pytest.approx(0.012)
    assert tier.counters.num_lookups == 1 and tier.counters.num_hit_requests == 0
    assert tier.counters.num_stored_blocks == 4
    assert decode.copies.store_busy_s == pytest.approx(0.004)
    assert _host_states(tier) == ["stored"] * 4
    decode.state.check()

    cluster = _decode_with_tier(version, None)
    a = Request(0, 0.0, 64, 3, hash_ids=(1, 2, 3, 4), hash_block_tokens=16)
    cluster.run([a])
    decode = cluster.replicas[1]
    assert a.status is Status.FINISHED and a.finish_s == pytest.approx(0.042)
    assert len(decode.log) == 3  # (the empty step at 42 ms computes nothing: not logged)
    assert decode.state.kv.num_used_blocks == 0 and not decode.state.offload.delayed
    assert _host_states(decode.state.offload.tier) == [0] * 4
    decode.state.check()


@pytest.mark.parametrize("version", ["0.15.1", "0.33.0"])
def test_a_request_preempted_on_the_decode_replica_loads_its_prompt_back(version):
    """Decode replica of 5 usable blocks (6, less vLLM's null block). A (32-token prompt,
    blocks 1-2, 20 tokens out) is prefilled 0-10 ms, its KV crosses 10-11 ms; B (32 tokens,
    blocks 3-4, 5 out) arrives at 5 ms, is prefilled 10-20 ms. Decode steps, 10 ms each:
    - 11-21: A's first (its prompt's last token again); its 2 prompt blocks to store (21-23).
    - 21: B is taken (2 blocks), then A's second step takes its 3rd block (free: 0); B's KV
      crosses 21-22. 21-31: A.
    - 31-41: A and B's first; B's 2 prompt blocks to store, from the next launch.
    - 41: B's second step needs a block, none is free: B (the newest) is preempted, its
      blocks freed (cached, tail first). Its stores (41-43) must end before the step runs
      (`handle_preemptions`), so it launches at 43: 43-53, then A's steps end 63, ..., 213.
    - 53-203: B heads the queue, its two prompt blocks a GPU hit, but no block is free for
      its next token (one lookup of the tier each plan). A's 18th step (plan at 183) takes
      the free queue's front, B's tail block (block 4) leaving the GPU's cache.
    - 213: A finishes (its third block, tokens 32-47, is stored too under 0.15.1, whose
      connector stores decode blocks; 0.33.0's stores prompt blocks only). 0.15.1 frees its
      blocks once the poll of the empty step launched then finds its stores done, and asks B
      again; 0.33.0 frees them at once. B: GPU hit block 3, the tier holds block 4 (its
      store completed at the preemption, 0.15.1; its job reported at 53 ms, 0.33.0): it
      loads it, 213-214 ms, is admitted at 214 and computes its token 33 again: steps end
      224, 234, 244, 254 (its tokens 2-5).
    Lookups: A's and B's as their transfers are taken, B's 16 asks (plans at 53-203) and, at
    213, one more (0.15.1: asked before and after A's blocks are freed)."""
    cluster = _decode_with_tier(version, None, num_decode_blocks=6)
    a = Request(0, 0.0, 32, 20, hash_ids=(1, 2), hash_block_tokens=16)
    b = Request(1, 0.005, 32, 5, hash_ids=(3, 4), hash_block_tokens=16)
    cluster.run([a, b])
    decode = cluster.replicas[1]
    counters = decode.state.offload.tier.counters
    old = version == "0.15.1"
    assert (a.transfer_end_s, b.transfer_start_s, b.transfer_end_s) == pytest.approx(
        (0.011, 0.021, 0.022))
    assert (a.num_preemptions, b.num_preemptions) == (0, 1)
    ends = decode.log.end_s()
    assert ends[:4] == pytest.approx([0.021, 0.031, 0.041, 0.053])
    assert ends[-5:] == pytest.approx([0.213, 0.224, 0.234, 0.244, 0.254])
    assert (a.finish_s, b.finish_s) == pytest.approx((0.213, 0.254))
    assert counters.num_lookups == (20 if old else 19)
    assert counters.num_stored_blocks == (5 if old else 4)
    assert (counters.num_hit_requests, counters.num_loaded_blocks, counters.num_hit_tokens,
            counters.num_first_hit_tokens) == (1, 1, 16, 0)  # (a reload: no first hit)
    assert decode.copies.load_busy_s == pytest.approx(0.001)
    assert decode.copies.store_busy_s == pytest.approx(0.005 if old else 0.004)
    assert decode.state.kv.num_used_blocks == 0
    decode.state.check()


@pytest.mark.parametrize(("replica", "field", "words"), [
    ({"scheduler": {"name": "vllm_v1", "speculative": {
        "method": "ngram", "num_speculative_tokens": 2, "acceptance_rate": 0.5}}},
     "cluster.decode.replica.scheduler.speculative.method",
     "with speculative decoding on a decode pool is not modelled yet"),
    ({"scheduler": {"name": "vllm_v1", "decode_reserve_tokens": 8}},
     "cluster.decode.replica.kv_offload", "leave decode_reserve_tokens at 0"),
])
def test_what_a_decode_pool_tier_refuses_is_named(replica, field, words):
    base = {"prefix_caching": True, "kv_offload": {"size_gib": 1.0}, **replica}
    with pytest.raises(InputError) as err:
        Cluster(parse_scenario({
            "name": "refused", "seed": 0,
            "workload": {"format": "synthetic", "num_requests": 1,
                         "arrivals": {"process": "poisson", "qps": 1.0},
                         "lengths": {"prompt": {"dist": "fixed", "value": 1},
                                     "output": {"dist": "fixed", "value": 1}}},
            "replica": {"model": "qwen3-30b-a3b", "scheduler": {"name": "vllm_v1"}},
            "cluster": {"prefill": {"replicas": 1}, "decode": {"replicas": 1, "replica": base}}},
            "<test>"))
    assert err.value.field == field and words in str(err.value)


def test_the_summary_gives_the_decode_pools_tier_apart():
    """Tiers on both pools: `summary.kv_offload` sums them (hit rates are the first
    admissions', on the prefill side), and `pools` gives each pool's own; `simulate`'s line
    names the decode pool's. Two 80-token prompts (5 blocks) sharing a 64-token system
    prompt (4 blocks), 5 tokens out each, about 1 s apart: each replica stores the first's 5
    blocks and the second's own fifth, 6 each (the second's GPU hit covers the shared 4 on
    the prefill replica; on the decode replica its lookup finds them in the tier, and the
    transfer connector claims it all the same: no load)."""
    from sim import run_scenario
    from sim.cli.run import offload_line

    data = _data("0.15.1", None)
    prefill = data["cluster"]["prefill"]["replica"]
    prefill["kv_offload"] = data["cluster"]["decode"]["replica"]["kv_offload"]
    data["workload"] = {"format": "shared_prefix", "num_groups": 1, "num_prompts_per_group": 2,
                        "system_prompt_tokens": 64, "question_tokens": 16, "output_tokens": 5,
                        "rate_qps": 1.0, "duration_s": 2.0}
    res = run_scenario(parse_scenario(data, "<test>"))
    off = res.summary["kv_offload"]
    assert set(off["pools"]) == {"prefill", "decode"}
    assert off["pools"]["decode"]["num_stored_blocks"] == 6
    assert off["pools"]["prefill"]["num_stored_blocks"] == 6
    assert off["num_stored_blocks"] == 12
    assert off["pools"]["decode"]["num_lookups"] == 2 and off["pools"]["decode"]["num_loads"] == 0
    assert "on the decode pool: 6 stored" in offload_line(res.summary)
