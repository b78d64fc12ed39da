"""Invariants over random workloads and configurations (hypothesis): every request ends once,
tokens are conserved, time moves forward, budgets and capacity hold, on one replica and on
colocated and disaggregated clusters; the same seed writes the same files."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from sim import run_scenario
from sim.config.scenario import parse_scenario
from tests.strategies import assert_nothing_lost, clusters, scenarios


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_invariants(data):
    scenario = parse_scenario(data, "hypothesis")
    res = run_scenario(scenario)
    req, it, tokens = res.requests, res.iterations, res.tokens

    # Every request given ends exactly once: finished, or with a reason; none is dropped.
    assert_nothing_lost(data, res)
    done = req[req["status"] == "finished"]
    assert (req.loc[req["status"] == "rejected", "num_generated_tokens"] == 0).all()

    # Tokens are conserved: what iterations computed is what requests hold or recomputed, less
    # what came from the prefix cache; with speculative decoding, and the drafts verified but
    # not kept (rejected, or accepted past a request's last token: both given back; at most
    # every draft verified).
    spec = "num_spec_tokens" in it
    assert spec == ("speculative" in data["replica"]["scheduler"])
    drafts = it["num_spec_tokens"] if spec else 0
    computed = int((it["num_prefill_tokens"] + it["num_decode_tokens"] + drafts).sum())
    held = int((req["num_computed_tokens"] + req["num_recomputed_tokens"]).sum())
    if spec:
        # (A prompt's last chunk may carry drafts too: logged among its prefill tokens.)
        verified = int(req["num_drafts_verified"].sum())
        computed -= min(max(computed - held, 0), verified)
    if data["replica"]["prefix_caching"]:
        # Each admission hits at most the tokens it knows (a preempted request hits its own
        # output blocks too, as in vLLM).
        known = req["num_prompt_tokens"] + req["num_output_tokens"]
        assert computed <= held and computed >= held - int(
            known.sum() * (1 + req["num_preemptions"].max()))
        assert (req["num_cached_tokens"] < req["num_prompt_tokens"]).all()
    else:
        assert computed == held and (req["num_cached_tokens"] == 0).all()
    # A finished request computed all but its last token; or, preempted with its last token in
    # flight (vLLM's async scheduling delivers it), it finished from the queue, holding none.
    # (Speculative: a last step's drafts accepted past the last token are computed too.)
    last = done["num_prompt_tokens"] + done["num_output_tokens"] - 1
    whole = (done["num_computed_tokens"] >= last) if spec else (
        done["num_computed_tokens"] == last)
    from_queue = (done["num_computed_tokens"] == 0) & (done["num_preemptions"] > 0)
    assert (whole | from_queue).all()
    # A row per streamed token; speculative decoding streams several at a step in one row.
    if spec:
        assert len(tokens) <= int(req["num_generated_tokens"].sum())
        assert (req["num_drafts_accepted"] <= req["num_drafts_verified"]).all()
    else:
        assert len(tokens) == int(req["num_generated_tokens"].sum())
        assert (req["num_drafts_verified"] == 0).all()

    # Time moves forward: TBTs positive, latencies non-negative, iterations back to back.
    times = tokens.groupby("request_id")["time_s"]
    assert (times.diff().dropna() > 0).all()
    assert (done["ttft_s"] >= 0).all() and (done["scheduling_delay_s"] >= 0).all()
    assert (done["e2e_s"] >= done["ttft_s"]).all()
    ends = (it["start_s"] + it["duration_s"]).to_numpy()
    assert np.all(it["start_s"].to_numpy()[1:] >= ends[:-1])

    # Budgets and capacity hold in every iteration.
    sched = data["replica"]["scheduler"]
    per_iteration = it["num_prefill_tokens"] + it["num_decode_tokens"] + drafts
    if sched["name"] == "chunked_prefill":
        assert (per_iteration <= sched["token_budget"]).all()
    if sched["name"] == "vllm_v1":
        assert (per_iteration <= sched["max_num_batched_tokens"]).all()
    if sched["name"] == "sglang":
        assert (it["num_prefill_tokens"] <= sched["chunked_prefill_size"]).all()
        # Prefill and decode batches are separate iterations; with prefix caching a re-admitted
        # preempted request may extend one token, which the log counts as a decode (see
        # tests/schedulers/test_sglang.py).
        if not sched["mixed_chunk"] and not data["replica"]["prefix_caching"]:
            assert ((it["num_prefill_tokens"] == 0) | (it["num_decode_tokens"] == 0)).all()
    assert (it["num_seqs"] <= sched["max_num_seqs"]).all()
    assert (it["num_kv_blocks_used"] <= data["replica"]["kv_cache"]["num_blocks"]).all()


@settings(max_examples=10, deadline=None)
@given(scenarios())
def test_same_seed_gives_identical_files(data):
    scenario = parse_scenario(data, "hypothesis")
    with tempfile.TemporaryDirectory() as tmp:
        first, second = Path(tmp, "first"), Path(tmp, "second")
        run_scenario(scenario, out_dir=first)
        run_scenario(scenario, out_dir=second)
        names = sorted(p.name for p in first.iterdir())
        assert names == sorted(p.name for p in second.iterdir())
        assert {"requests.parquet", "iterations.parquet", "summary.json", "scenario.yaml",
                "tokens.parquet", "tbt_gaps.parquet", "inputs.json"} == set(names)
        for name in names:
            assert (first / name).read_bytes() == (second / name).read_bytes(), name


@pytest.mark.slow
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters())
def test_cluster_invariants(data):
    res = run_scenario(parse_scenario(data, "hypothesis"))
    req, tokens = res.requests, res.tokens
    assert_nothing_lost(data, res)
    assert (tokens.groupby("request_id")["time_s"].diff().dropna() > 0).all()
    moved = req[req["transfer_end_s"].notna()]
    # Never in two replicas at once: prefill, then the transfer, then the decode replica.
    assert (moved["prefill_end_s"] <= moved["transfer_start_s"]).all()
    assert (moved["transfer_start_s"] <= moved["transfer_end_s"]).all()
    second = tokens[tokens["token_index"] == 1].set_index("request_id")["time_s"]
    second = second[second.index.isin(moved["request_id"])]  # the first on the decode side
    ends = moved.set_index("request_id")["transfer_end_s"]
    assert (second >= ends.reindex(second.index)).all()
    assert (moved["decode_replica_id"] != moved["replica_id"]).all()
    if data["horizon_s"] is None:
        # KV blocks freed everywhere: the prefill side after each transfer, the decode side at
        # completion (and `state.check` verified conservation on every replica); with a CPU
        # tier, but those a finished request holds until vLLM polls its stores, at its next
        # step (none after the last request: vLLM's engine idles); and those queued requests
        # hold on a replica that stalled as vLLM 0.15.1 does (the reason says how many).
        for i, stats in enumerate(res.summary["replicas"]):
            expected = stats.get("kv_blocks_awaiting_stores_at_end", 0)
            on_replica = req[(req["replica_id"] == i) | (req["decode_replica_id"] == i)]
            stalled = on_replica.loc[on_replica["reason"].str.startswith("engine_stalled"),
                                     "reason"].unique()
            if len(stalled):
                assert len(stalled) == 1, stalled  # one reason per replica, the same for all
                held = re.search(r"behind it hold ([\d,]+) with KV", stalled[0])
                if held is None:  # (other stalls: the blocks are the stalled requests')
                    assert stats["kv_blocks_in_use_at_end"] >= expected
                    continue
                # (The queued requests' blocks and those awaiting stores may overlap.)
                num_held = int(held.group(1).replace(",", ""))
                assert (max(expected, num_held) <= stats["kv_blocks_in_use_at_end"]
                        <= expected + num_held), (i, stats)
                continue
            assert stats["kv_blocks_in_use_at_end"] == expected, (i, stats)
