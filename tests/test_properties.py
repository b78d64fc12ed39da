"""Invariants over random workloads and configurations (hypothesis)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from sim import run_scenario
from sim.config.scenario import parse_scenario


@st.composite
def scenarios(draw):
    block_size = draw(st.sampled_from([1, 4, 16]))
    max_prompt = draw(st.integers(1, 800))
    max_output = draw(st.integers(1, 80))
    # Enough blocks for the largest request, sometimes barely (preemption), sometimes plenty.
    min_blocks = -(-(max_prompt + max_output) // block_size)
    num_blocks = min_blocks + draw(st.integers(0, 3 * min_blocks))
    reserve = draw(st.sampled_from([None, 0, 8]))
    policy = draw(st.sampled_from(["chunked_prefill", "prefill_first", "vllm_v1", "sglang"]))
    if policy == "chunked_prefill":
        budget = draw(st.integers(8, 1024))
        max_num_seqs = draw(st.integers(1, min(budget, 64)))
        scheduler = {"name": "chunked_prefill", "token_budget": budget,
                     "max_num_seqs": max_num_seqs,
                     "chunk_size": draw(st.sampled_from([None, max(1, budget // 2)])),
                     "max_num_partial_prefills": draw(st.integers(1, min(3, max_num_seqs))),
                     "min_chunk_tokens": draw(st.sampled_from([None, max(1, budget // 4)])),
                     "decode_reserve_tokens": reserve}
    elif policy == "prefill_first":
        scheduler = {"name": "prefill_first", "max_num_seqs": draw(st.integers(1, 64)),
                     "max_num_batched_tokens": draw(st.sampled_from([None, 2048])),
                     "decode_reserve_tokens": reserve}
    elif policy == "vllm_v1":
        budget = draw(st.integers(8, 1024))
        chunking = draw(st.booleans())
        threshold = draw(st.sampled_from([0, max(1, budget // 3)])) if chunking else 0
        scheduler = {"name": "vllm_v1", "max_num_batched_tokens": budget,
                     "max_num_seqs": draw(st.integers(1, min(budget, 64))),
                     "enable_chunked_prefill": chunking,
                     "decode_reserve_tokens": draw(st.sampled_from([0, 0, None, 8]))}
        if threshold:
            scheduler["long_prefill_token_threshold"] = threshold
            scheduler["max_num_partial_prefills"] = draw(st.sampled_from([None, 1, 2]))
        if chunking:
            scheduler["min_chunk_tokens"] = draw(st.sampled_from(
                [None, max(1, min(budget, threshold or budget) // 4)]))
    else:
        scheduler = {"name": "sglang", "chunked_prefill_size": draw(st.integers(8, 1024)),
                     "max_num_seqs": draw(st.integers(1, 64)),
                     "mixed_chunk": draw(st.booleans()),
                     "decode_reserve_tokens": reserve}
    num_requests = draw(st.integers(1, 40))
    arrivals = {"process": "gamma", "qps": draw(st.floats(0.5, 200)),
                "cv": draw(st.floats(0.2, 4))}
    if draw(st.booleans()):
        workload = {"format": "synthetic", "num_requests": num_requests, "arrivals": arrivals,
                    "lengths": {"prompt": {"dist": "uniform", "low": 1, "high": max_prompt},
                                "output": {"dist": "uniform", "low": 1, "high": max_output}}}
    else:
        # Shared system prompts and multi-turn conversations: prefixes a cache can reuse.
        system = draw(st.sampled_from([0, 40, 200]))
        hash_block = draw(st.sampled_from([4, 16, 24, 32]))
        workload = {"format": "prefix", "num_conversations": num_requests,
                    "arrivals": arrivals,
                    "question_tokens": {"dist": "uniform", "low": 1,
                                        "high": max(1, max_prompt // 4)},
                    "output_tokens": {"dist": "uniform", "low": 1, "high": max_output},
                    "hash_block_tokens": hash_block}
        if system >= hash_block:
            workload.update(system_prompt_tokens=system,
                            num_groups=draw(st.integers(1, 3)))
        turns = draw(st.integers(1, 3))
        if turns > 1:
            workload.update(num_turns=turns, think_time_s=draw(st.sampled_from([0.0, 0.05, 1.0])))
        workload["num_requests"] = num_requests
        # The longest prompt: every turn's question and answer, after the system prompt.
        max_prompt = system + turns * (max(1, max_prompt // 4) + max_output)
        min_blocks = -(-(max_prompt + max_output) // block_size)
        num_blocks = min_blocks + draw(st.integers(0, 3 * min_blocks))
    return {
        "seed": draw(st.integers(0, 2**16)),
        "workload": workload,
        "replica": {"scheduler": scheduler,
                    "latency": {**draw(st.sampled_from([{"kind": "roofline"},
                                                        {"kind": "constant",
                                                         "iteration_s": 0.01}])),
                                # Jitter sometimes: fast-forward must still equal stepping.
                                "noise": draw(st.sampled_from([
                                    {"kind": "none"}, {"kind": "none"},
                                    {"kind": "lognormal", "sigma": 0.3},
                                    {"kind": "lognormal", "sigma": 0.1, "correlation": 0.8}]))},
                    # (vLLM never allocates its null block: one more for the largest request)
                    "kv_cache": {"block_size": block_size,
                                 "num_blocks": num_blocks + (scheduler["name"] == "vllm_v1")},
                    "prefix_caching": draw(st.booleans())},
        "horizon_s": draw(st.sampled_from([None, None, 0.5, 3.0])),
        "record_token_times": True,
    }


def assert_nothing_lost(data, res):
    """Every request appears once with a status and a reason; tokens are conserved (a request
    generates exactly its output length, or fewer if unfinished); busy fractions within [0, 1]."""
    req = res.requests
    assert len(req) == data["workload"]["num_requests"]
    assert req["request_id"].tolist() == list(range(len(req)))
    assert set(req["status"]) <= {"finished", "rejected", "unfinished"}
    assert ((req["status"] == "finished") == (req["reason"] == "")).all()
    if data["horizon_s"] is None:
        assert (req["status"] != "unfinished").all()
    else:
        late = req["arrival_s"] >= data["horizon_s"]
        assert (req.loc[late, "reason"].str.startswith("after_horizon")).all()
    done = req["status"] == "finished"
    assert (req.loc[done, "num_generated_tokens"] == req.loc[done, "num_output_tokens"]).all()
    assert (req["num_generated_tokens"] <= req["num_output_tokens"]).all()
    if res.tokens is not None:
        counts = res.tokens.groupby("request_id").size()
        assert counts.reindex(req["request_id"], fill_value=0).tolist() == req[
            "num_generated_tokens"].tolist()
    summary = res.summary
    assert summary["requests"]["total"] == len(req)
    assert sum(summary["requests"]["reasons"].values()) == int((req["reason"] != "").sum())
    for replica in summary["replicas"]:
        assert replica["busy_fraction"] is None or 0 <= replica["busy_fraction"] <= 1 + 1e-12


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
    # what came from the prefix cache.
    computed = int(it["num_prefill_tokens"].sum() + it["num_decode_tokens"].sum())
    held = int((req["num_computed_tokens"] + req["num_recomputed_tokens"]).sum())
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
    whole = done["num_computed_tokens"] == done["num_prompt_tokens"] + done["num_output_tokens"] - 1
    from_queue = (done["num_computed_tokens"] == 0) & (done["num_preemptions"] > 0)
    assert (whole | from_queue).all()
    assert len(tokens) == int(req["num_generated_tokens"].sum())

    # Time moves forward: TBTs positive, latencies non-negative, iterations back to back.
    times = tokens.groupby("request_id")["time_s"]
    assert (times.diff().dropna() > 0).all()
    assert (done["ttft_s"] >= 0).all() and (done["scheduling_delay_s"] >= 0).all()
    assert (done["e2e_s"] >= done["ttft_s"]).all()
    ends = (it["start_s"] + it["duration_s"]).to_numpy()
    assert np.all(it["start_s"].to_numpy()[1:] >= ends[:-1])

    # Budgets and capacity hold in every iteration.
    sched = data["replica"]["scheduler"]
    per_iteration = it["num_prefill_tokens"] + it["num_decode_tokens"]
    if sched["name"] == "chunked_prefill":
        assert (per_iteration <= sched["token_budget"]).all()
    if sched["name"] == "vllm_v1":
        assert (per_iteration <= sched["max_num_batched_tokens"]).all()
    if sched["name"] == "sglang":
        assert (it["num_prefill_tokens"] <= sched["chunked_prefill_size"]).all()
        # Prefill and decode batches are separate iterations; with prefix caching a re-admitted
        # preempted request may extend one token, which the log counts as a decode (see
        # tests/test_sglang.py).
        if not sched["mixed_chunk"] and not data["replica"]["prefix_caching"]:
            assert ((it["num_prefill_tokens"] == 0) | (it["num_decode_tokens"] == 0)).all()
    assert (it["num_seqs"] <= sched["max_num_seqs"]).all()
    assert (it["num_kv_blocks_used"] <= data["replica"]["kv_cache"]["num_blocks"]).all()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_fast_forward_is_exact(data):
    scenario = parse_scenario(data, "hypothesis")
    fast, slow = run_scenario(scenario), run_scenario(scenario, fast_forward=False)
    assert fast.requests.equals(slow.requests)
    assert fast.iterations.equals(slow.iterations)
    assert fast.tokens.equals(slow.tokens)
    assert fast.summary == slow.summary


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


@st.composite
def clusters(draw):
    """A small workload through a random colocated or disaggregated cluster."""
    data = draw(scenarios())
    replica = data["replica"]
    if replica["scheduler"]["name"] == "prefill_first":
        # Keep whole prompts within a replica's reach in every pool.
        replica["scheduler"]["max_num_batched_tokens"] = None
    if draw(st.booleans()):
        data["cluster"] = {"replicas": draw(st.integers(1, 3)),
                           "router": {"name": draw(st.sampled_from(
                               ["round_robin", "least_outstanding", "least_kv_load", "random",
                                "prefix_affinity"]))}}
    else:
        decode = {**replica, "kv_cache": {**replica["kv_cache"]}}
        decode["kv_cache"]["num_blocks"] = replica["kv_cache"]["num_blocks"] + draw(
            st.integers(0, 50))
        data["cluster"] = {
            "prefill": {"replicas": draw(st.integers(1, 2)), "replica": replica},
            "decode": {"replicas": draw(st.integers(1, 2)), "replica": decode},
            "link": {"bandwidth_gb_s": draw(st.sampled_from([0.001, 0.1, 50.0])),
                     "latency_s": draw(st.sampled_from([0.0, 1e-3]))},
            "overlap_transfer": draw(st.booleans()),
            "router": {"name": draw(st.sampled_from(["round_robin", "least_kv_load",
                                                     "prefix_affinity"]))},
        }
        del data["replica"]  # the pools say what their replicas are
    return data


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
        # completion (and `state.check` verified conservation on every replica).
        assert [r["kv_blocks_in_use_at_end"] for r in res.summary["replicas"]] == [0] * len(
            res.summary["replicas"])


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters())
def test_cluster_fast_forward_is_exact(data):
    """Every cluster kind and router: fast-forward equals stepping, to the last bit. Events at
    the same instant (common with the constant model) happen in one fixed order in both modes:
    finished iterations first, then arrivals and transfers, then planning in replica order."""
    scenario = parse_scenario(data, "hypothesis")
    fast, slow = run_scenario(scenario), run_scenario(scenario, fast_forward=False)
    assert fast.requests.equals(slow.requests)
    assert fast.iterations.equals(slow.iterations)
    assert fast.tokens.equals(slow.tokens)
    assert fast.summary == slow.summary


def run_checking_reserved_blocks(data: dict) -> list[bool]:
    """Run `data` with every policy's `reserved_blocks` checked against the sum over the
    running requests (`summed_reserved_blocks`) at every call; return, per call, whether it
    asked for a full reservation (the kept counts' case)."""
    import sim.schedulers.base as base
    from sim.schedulers import chunked_prefill, prefill_first, sglang, vllm_v1

    calls: list[bool] = []
    kept = base.reserved_blocks

    def checked(state, reserve_tokens):
        got = kept(state, reserve_tokens)
        assert got == base.summed_reserved_blocks(state, reserve_tokens)
        calls.append(reserve_tokens is None)
        return got

    modules = (base, chunked_prefill, prefill_first, sglang, vllm_v1)
    saved = [module.reserved_blocks for module in modules]
    try:
        for module in modules:
            module.reserved_blocks = checked
        run_scenario(parse_scenario(data, "hypothesis"))
    finally:
        for module, original in zip(modules, saved, strict=True):
            module.reserved_blocks = original
    return calls


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters())
def test_reserved_blocks_from_kept_counts_equal_the_sum(data):
    """`reserved_blocks` takes a full reservation from two kept counts where every block in
    use is a running request's; at every call of every policy it equals the sum."""
    calls = run_checking_reserved_blocks(data)
    event(f"full reservations asked: {any(calls)}")


def test_reserved_blocks_kept_counts_under_overload():
    """A queue that never drains: a full reservation asked at most iterations (`sglang` admits
    by SGLang's own budget, `sim.schedulers.sglang_admission`, and asks none)."""
    for name in ("prefill_first", "chunked_prefill"):
        data = {"seed": 1, "workload": {
            "format": "synthetic", "num_requests": 200,
            "arrivals": {"process": "poisson", "qps": 400},
            "lengths": {"prompt": {"dist": "uniform", "low": 10, "high": 300},
                        "output": {"dist": "uniform", "low": 5, "high": 120}}},
            "replica": {"model": "tiny", "latency": {"kind": "constant", "iteration_s": 0.01},
                        "scheduler": {"name": name, "max_num_seqs": 16},
                        "kv_cache": {"block_size": 4, "num_blocks": 600}}}
        calls = run_checking_reserved_blocks(data)
        assert sum(calls) > 50, (name, len(calls))
