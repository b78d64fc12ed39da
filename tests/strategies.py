"""Random scenarios and clusters for the property tests (hypothesis), and the check that a run
lost no request and no token."""

from __future__ import annotations

from hypothesis import strategies as st


@st.composite
def scenarios(draw, offload: bool = False, data_parallel: bool = False,
              host_cache: bool = False):
    """A random scenario; `offload`: always vLLM v1 (0.15.1 or 0.33.0) with prefix caching and
    a CPU tier for the KV cache (elsewhere the tier is drawn now and then); `data_parallel`:
    vLLM v1 or SGLang on 2 or 4 data-parallel ranks of an MoE model, experts spread over them
    or not; `host_cache`: always SGLang with its hierarchical cache (elsewhere drawn now and
    then)."""
    block_size = draw(st.sampled_from([1, 4, 16]))
    max_prompt = draw(st.integers(1, 800))
    max_output = draw(st.integers(1, 80))
    # Enough blocks for the largest request, sometimes barely (preemption), sometimes plenty.
    min_blocks = -(-(max_prompt + max_output) // block_size)
    num_blocks = min_blocks + draw(st.integers(0, 3 * min_blocks))
    reserve = draw(st.sampled_from([None, 0, 8]))
    policy = "vllm_v1" if offload else "sglang" if host_cache else draw(
        st.sampled_from(["vllm_v1", "sglang"])) if data_parallel else draw(
        st.sampled_from(["chunked_prefill", "prefill_first", "vllm_v1", "sglang"]))
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
        # vLLM's priority policy sometimes: the queue by priority, victims anywhere.
        scheduler["scheduling_policy"] = draw(st.sampled_from(["fcfs", "fcfs", "priority"]))
        # Speculative decoding sometimes, either release, synchronous or not (rule 18).
        if data_parallel:
            scheduler["engine_version"] = draw(st.sampled_from(["0.15.1", "0.33.0"]))
            scheduler["async_scheduling"] = draw(st.booleans())
        # A CPU tier follows 0.15.1's or 0.33.0's connector.
        tier_033 = offload and draw(st.booleans())
        if tier_033:
            scheduler.update(engine_version="0.33.0", async_scheduling=draw(st.booleans()))
        if draw(st.integers(0, 3)) == 0:
            method = draw(st.sampled_from(["ngram", "eagle", "draft_model"]))
            k = draw(st.integers(1, 5))
            scheduler.pop("min_chunk_tokens", None)
            scheduler["engine_version"] = ("0.33.0" if tier_033 else "0.15.1" if offload
                                           else draw(st.sampled_from(["0.15.1", "0.33.0"])))
            scheduler["speculative"] = {
                "method": method, "num_speculative_tokens": k,
                "acceptance_rate": draw(st.sampled_from([0.0, 0.5, 0.8, 1.0])),
                "draft_time_ratio": draw(st.sampled_from([0.0, 0.1]))}
            if method == "ngram":  # (lookups that miss now and then)
                scheduler["speculative"]["match_rate"] = draw(st.sampled_from([1.0, 0.5]))
            if (scheduler["engine_version"] == "0.33.0" and not data_parallel
                    and draw(st.booleans())):  # 0.33.0's dynamic k (not on ranks: refused)
                edge = draw(st.integers(1, 8))
                scheduler["speculative"]["num_speculative_tokens_per_batch_size"] = [
                    [1, edge, k], [edge + 1, 4096, draw(st.integers(0, k))]]
            if (scheduler["engine_version"] == "0.33.0"
                    and "num_speculative_tokens_per_batch_size" not in scheduler["speculative"]
                    and 0 < scheduler.get("long_prefill_token_threshold", 0) < 1 + k):
                # (0.33.0 pads a decode it admits to 1 + k tokens: a smaller threshold fails
                # its scheduler's assertion, and is refused)
                scheduler["long_prefill_token_threshold"] = 1 + k
            scheduler.pop("async_scheduling", None)
            if method == "eagle" or scheduler["engine_version"] == "0.33.0":
                scheduler["async_scheduling"] = draw(st.booleans())
    else:
        scheduler = {"name": "sglang", "chunked_prefill_size": draw(st.integers(8, 1024)),
                     "max_num_seqs": draw(st.integers(1, 64)),
                     "mixed_chunk": draw(st.booleans()),
                     "decode_reserve_tokens": None if host_cache else reserve}
        # SGLang's priority scheduling sometimes: the queue by level, preemption by threshold.
        if draw(st.integers(0, 2)) == 0:
            scheduler.update(enable_priority_scheduling=True, decode_reserve_tokens=None,
                             schedule_low_priority_values_first=draw(st.booleans()),
                             priority_scheduling_preemption_threshold=draw(
                                 st.sampled_from([0, 2, 10])))
        # Speculative decoding sometimes (rule 12): D tokens verified, 2L slots held, retraction.
        # (With the hierarchical cache: not a draft model, whose KV's size is not known.)
        elif draw(st.integers(0, 3)) == 0:
            algorithm = draw(st.sampled_from(
                ["eagle", "ngram"] if host_cache else ["eagle", "ngram", "standalone"]))
            steps, topk = draw(st.integers(1, 4)), draw(st.sampled_from([1, 1, 2]))
            if algorithm == "standalone":
                topk = 1
            draft = steps + 1 if topk == 1 else draw(
                st.integers(steps + 1, topk + (steps - 1) * topk ** 2 + 1))
            scheduler.update(mixed_chunk=False, decode_reserve_tokens=None, speculative={
                "algorithm": algorithm, "num_steps": steps, "eagle_topk": topk,
                "num_draft_tokens": draft,
                "acceptance_rate": draw(st.sampled_from([0.0, 0.5, 0.8, 1.0])),
                "draft_time_ratio": draw(st.sampled_from([0.0, 0.1]))})
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
    # Request classes sometimes: differing priorities where the policy orders by them.
    if draw(st.booleans()):
        by_priority = (scheduler.get("scheduling_policy") == "priority"
                       or scheduler.get("enable_priority_scheduling", False))
        workload["classes"] = [
            {"name": "a", "share": 0.25, "priority": 0, "slo": {"ttft_s": 0.2}},
            {"name": "b", "share": 0.75, "priority": draw(st.sampled_from([0, 3]))
             if by_priority else 0}]
    # A client timeout sometimes: aborts from the queue, the batch and (async) in flight.
    timeout_s = draw(st.sampled_from([None, None, 0.02, 0.2, 1.0]))
    if timeout_s is not None:
        workload["timeout_s"] = timeout_s
    # Closed-loop clients sometimes: sending then depends on finishes.
    clients = draw(st.sampled_from([None, None, None, {"concurrency": 1}, {
        "concurrency": draw(st.integers(1, 8)),
        "think_time_s": draw(st.sampled_from([0.0, 0.01, 0.2])),
        "think_time": draw(st.sampled_from(["fixed", "exponential"])),
        "paced": draw(st.booleans()),
        "warmup_requests": draw(st.sampled_from([0, 0, 3])),
        "duration_s": draw(st.sampled_from([None, None, 0.3, 2.0]))}]))
    prefix_caching = offload or host_cache or draw(st.booleans())
    # A CPU tier for the KV cache sometimes (vLLM's offloading connector): from a few
    # blocks to more than the GPU holds, copies slow or fast (the default model's block is
    # 128 KiB per token slot).
    cpu_tier = None
    if offload:
        scheduler["decode_reserve_tokens"] = 0  # (the tier refuses others)
    if (scheduler["name"] == "vllm_v1" and prefix_caching
            and (scheduler.get("engine_version", "0.15.1") == "0.15.1" or offload)
            and scheduler.get("decode_reserve_tokens") == 0
            and (offload or draw(st.integers(0, 2)) == 0)):
        num_cpu_blocks = draw(st.integers(1, 3 * num_blocks))
        cpu_tier = {"size_gib": num_cpu_blocks * block_size * 2**17 / 2**30,
                   "host_bandwidth_gb_s": draw(st.sampled_from([0.2, 2.0, 50.0]))}
        if scheduler.get("engine_version") == "0.33.0":  # (0.15.1 has neither: refused)
            if draw(st.booleans()):
                cpu_tier["eviction_policy"] = "arc"
            cpu_tier["store_threshold"] = draw(st.sampled_from([0, 0, 2, 3]))
    # SGLang's hierarchical cache sometimes: a host pool from the GPU's size to four times it,
    # backed up at the first or the second insertion or at eviction (write_back, the
    # scheduler waiting for each copy), copies slow or fast; with speculative
    # decoding sometimes (EAGLE's drafter layer copied too).
    if (scheduler["name"] == "sglang" and prefix_caching
            and scheduler.get("speculative", {}).get("algorithm") != "standalone"
            and scheduler.get("decode_reserve_tokens") is None
            and (host_cache or draw(st.integers(0, 2)) == 0)):  # (on ranks too: each its own)
        scheduler["hierarchical_cache"] = {
            "ratio": draw(st.sampled_from([1.0, 2.0, 4.0])),
            "write_policy": draw(st.sampled_from(["write_through", "write_through_selective",
                                                  "write_back"])),
            "host_bandwidth_gb_s": draw(st.sampled_from([0.2, 2.0, 50.0]))}
    if scheduler["name"] == "sglang" and block_size > 1:
        # SGLang's page: chunks of whole pages; pages of one token where its paged rules are
        # not modelled (refused), the same token slots.
        scheduler["chunked_prefill_size"] = -(-scheduler["chunked_prefill_size"]
                                               // block_size) * block_size
        if (scheduler.get("speculative") or scheduler.get("hierarchical_cache")
                or scheduler["mixed_chunk"]):
            num_blocks, block_size = num_blocks * block_size, 1
    data = {
        "seed": draw(st.integers(0, 2**16)),
        **({"clients": clients} if clients is not None else {}),
        "workload": workload,
        "replica": {"scheduler": scheduler,
                    "latency": {**draw(st.sampled_from([{"kind": "roofline"},
                                                        {"kind": "constant",
                                                         "iteration_s": 0.01}])),
                                # Jitter sometimes: fast-forward must still equal stepping.
                                "noise": draw(
                                    st.sampled_from([
                                        {"kind": "none"}, {"kind": "none"},
                                        {"kind": "lognormal", "sigma": 0.3},
                                        {"kind": "lognormal", "sigma": 0.1,
                                         "correlation": 0.8}]))},
                    # (vLLM never allocates its null block: one more for the largest request)
                    "kv_cache": {"block_size": block_size,
                                 "num_blocks": num_blocks + (scheduler["name"] == "vllm_v1")},
                    "prefix_caching": prefix_caching,
                    **({"kv_offload": cpu_tier} if cpu_tier is not None else {}),
                    # (experts over every rank's GPUs, or sliced over them)
                    **({"model": "qwen3-30b-a3b", "parallelism": {
                        "data": (ranks := draw(st.sampled_from([2, 4]))),
                        "expert": draw(st.sampled_from([ranks, 1]))}}
                       if data_parallel else {}),
                    # No API front end sometimes: an answer then reaches its client at the
                    # finish itself, and a request it sends ties with the replica's next plan.
                    "engine": draw(st.sampled_from(["auto", "none"]))},
        "horizon_s": draw(st.sampled_from([None, None, 0.5, 3.0])),
        "record_token_times": True,
    }
    replica = data["replica"]
    if data_parallel and policy == "sglang":
        # DP attention: each rank prefills a ranks'th of the chunk, in whole pages; the
        # controller's balancer by each of its methods.
        ranks = replica["parallelism"]["data"]
        scheduler["chunked_prefill_size"] = ranks * block_size * draw(st.integers(1, 64))
        scheduler["load_balance_method"] = draw(st.sampled_from(
            ["auto", "round_robin", "follow_bootstrap_room", "total_requests",
             "total_tokens"]))
    if (data_parallel and replica["latency"]["kind"] == "roofline"
            and replica["parallelism"]["expert"] > 1):
        # vLLM's all-to-all backends for experts spread over the ranks (DeepEP's normal
        # kernels turn CUDA graphs off: no step padded); SGLang's auto mode too.
        replica["latency"]["all2all_backend"] = draw(st.sampled_from(
            ["allgather_reducescatter", "deepep_high_throughput", "deepep_low_latency",
             *(["deepep_auto"] if scheduler["name"] == "sglang" else [])]))
    return data


def assert_nothing_lost(data, res):
    """Every request appears once with a status and a reason; tokens are conserved (a request
    generates exactly its output length, or fewer if unfinished); busy fractions within [0, 1]."""
    req = res.requests
    assert len(req) == data["workload"]["num_requests"]
    assert req["request_id"].tolist() == list(range(len(req)))
    assert set(req["status"]) <= {"finished", "rejected", "failed", "unfinished"}
    # (SGLang aborts a request its KV cannot hold even alone: speculative decoding.)
    oom = req["reason"].str.startswith("kv_oom")
    failed = (req["status"] == "failed") & ~oom
    assert (req.loc[oom, "status"] == "failed").all()
    assert req.loc[failed, "reason"].str.startswith("client_timeout").all()
    assert (req.loc[failed, "failed_s"] == req.loc[failed, "arrival_s"]
            + data["workload"].get("timeout_s", 0)).all()
    assert req.loc[~failed & ~oom, "failed_s"].isna().all()
    assert ((req["status"] == "finished") == (req["reason"] == "")).all()
    # (A CPU tier may stall the engine, as it stalls vLLM 0.15.1: the queue's head waits for
    # blocks that loaded requests behind it hold.)
    # (A later turn of a session then never goes: "after_horizon: never sent".)
    replicas = [data["replica"]] if "replica" in data else [
        data["cluster"][pool]["replica"] for pool in ("prefill", "decode")]
    stalled = (("engine_stalled", "after_horizon: never sent")
               if any("kv_offload" in r for r in replicas) else ())
    if data["horizon_s"] is None:  # only a session's turns after one that got no answer, or
        # requests the clients never sent in their duration
        assert req.loc[req["status"] == "unfinished", "reason"].str.startswith(
            ("abandoned", "after_duration", *stalled)).all()
    else:
        late = req["arrival_s"] >= data["horizon_s"]
        assert (req.loc[late, "reason"].str.startswith(("after_horizon", "abandoned",
                                                        "after_duration"))).all()
    done = req["status"] == "finished"
    assert (req.loc[done, "num_generated_tokens"] == req.loc[done, "num_output_tokens"]).all()
    assert (req["num_generated_tokens"] <= req["num_output_tokens"]).all()
    if res.tokens is not None:
        counts = res.tokens.groupby("request_id").size().reindex(
            req["request_id"], fill_value=0).to_numpy()
        generated = req["num_generated_tokens"].to_numpy()
        if any("speculative" in r["scheduler"] for r in replicas):
            # A row per streamed chunk: a step's sampled token and the drafts it accepted.
            assert (counts <= generated).all()
            assert (generated - counts <= req["num_drafts_accepted"].to_numpy()).all()
        else:
            assert counts.tolist() == generated.tolist()
    summary = res.summary
    assert summary["requests"]["total"] == len(req)
    assert sum(summary["requests"]["reasons"].values()) == int((req["reason"] != "").sum())
    for replica in summary["replicas"]:
        assert replica["busy_fraction"] is None or 0 <= replica["busy_fraction"] <= 1 + 1e-12


def without_speculative(replica: dict, *, speculative: bool = True,
                        cpu_tier: bool = False, priority: bool = True) -> None:
    """Take speculative decoding (and the async setting drawn with it; not with `speculative`
    false), the KV cache's host tiers and SGLang's priority scheduling (not with `priority`
    false) off a replica: refused where they are not modelled yet (pipelines; data-parallel
    ranks and disaggregated pools but speculative decoding and, on those pools, SGLang's
    priorities). `cpu_tier`: keep vLLM's CPU tier (pipelines take it), its engine
    synchronous (vLLM's is on a pipeline)."""
    if speculative and replica["scheduler"].pop("speculative", None) is not None:
        replica["scheduler"].pop("async_scheduling", None)
    if cpu_tier and "kv_offload" in replica:
        replica["scheduler"]["async_scheduling"] = False
        # (a pipeline stage's GPU holds its share of the layers: up to 11 of 32 on 3)
        replica["kv_offload"] = {**replica["kv_offload"],
                                 "size_gib": replica["kv_offload"]["size_gib"] * 1.5}
    else:
        replica.pop("kv_offload", None)
    replica["scheduler"].pop("hierarchical_cache", None)
    if priority:  # (SGLang's: not on pipelines)
        replica["scheduler"].pop("enable_priority_scheduling", None)


@st.composite
def clusters(draw, host_tier: bool = False):
    """A small workload through a random colocated or disaggregated cluster (whose decode pool
    may keep vLLM's CPU tier); `host_tier`: always disaggregated, a KV cache's host tier on
    the prefill pool (vLLM's CPU tier or SGLang's hierarchical cache)."""
    if host_tier:
        data = draw(st.one_of(scenarios(offload=True), scenarios(host_cache=True)))
    else:
        data = draw(scenarios())
    replica = data["replica"]
    if replica["scheduler"]["name"] == "prefill_first":
        # Keep whole prompts within a replica's reach in every pool.
        replica["scheduler"]["max_num_batched_tokens"] = None
    if not host_tier and draw(st.booleans()):
        data["cluster"] = {"replicas": draw(st.integers(1, 3)),
                           "router": {"name": draw(st.sampled_from(
                               ["round_robin", "least_outstanding", "least_kv_load", "random",
                                "prefix_affinity"]))}}
    else:
        # (refused on disaggregated pools; a host tier on the prefill pool only)
        tiers = {"kv_offload": replica.get("kv_offload"),
                 "hierarchical_cache": replica["scheduler"].get("hierarchical_cache")}
        without_speculative(replica, speculative=False, priority=False)
        decode = {**replica, "kv_cache": {**replica["kv_cache"]},
                  "scheduler": {**replica["scheduler"]}}
        if tiers["kv_offload"] is not None:
            replica["kv_offload"] = tiers["kv_offload"]
        if tiers["hierarchical_cache"] is not None:
            replica["scheduler"]["hierarchical_cache"] = tiers["hierarchical_cache"]
        decode["kv_cache"]["num_blocks"] = replica["kv_cache"]["num_blocks"] + draw(
            st.integers(0, 50))
        # A CPU tier on the decode pool sometimes (vLLM's connector beside the transfer one:
        # it stores the prompt blocks that arrive, and loads for requests preempted there),
        # either connector, the prefill pool's tier or one of its own.
        tiered = host_tier and tiers["kv_offload"] is not None
        if (decode["scheduler"]["name"] == "vllm_v1" and "speculative" not in decode["scheduler"]
                and draw(st.integers(0, 1 if tiered else 2)) == 0):
            dec = decode["scheduler"]
            dec["decode_reserve_tokens"] = 0  # (the tier refuses others)
            decode["prefix_caching"] = True
            if draw(st.booleans()):
                dec.update(engine_version="0.33.0", async_scheduling=draw(st.booleans()))
            else:
                dec.update(engine_version="0.15.1")
            num_cpu_blocks = draw(st.integers(1, 3 * decode["kv_cache"]["num_blocks"]))
            block_size = decode["kv_cache"]["block_size"]
            decode["kv_offload"] = tiers["kv_offload"] if tiered and draw(st.booleans()) else {
                "size_gib": num_cpu_blocks * block_size * 2**17 / 2**30,
                "host_bandwidth_gb_s": draw(st.sampled_from([0.2, 2.0, 50.0]))}
            if dec["engine_version"] == "0.15.1":  # (0.15.1 has neither: refused)
                decode["kv_offload"] = {key: value for key, value in decode["kv_offload"].items()
                                        if key not in ("eviction_policy", "store_threshold")}
            elif draw(st.booleans()):
                decode["kv_offload"] = {**decode["kv_offload"], "eviction_policy": "arc",
                                        "store_threshold": draw(st.sampled_from([0, 2]))}
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


@st.composite
def data_parallel_clusters(draw, offload: bool = False):
    """A small workload through a disaggregated cluster whose prefill pool, decode pool or
    both are replicas of data-parallel ranks (vLLM v1, an MoE model); `offload`: a CPU tier
    for the KV cache on both pools (but a decode pool's beside speculative decoding)."""
    data = draw(scenarios(data_parallel=True, offload=offload))
    replica = data.pop("replica")
    # (speculative decoding: either pool; a CPU tier too, but not beside speculative
    # decoding on the decode pool)
    without_speculative(replica, speculative=False, cpu_tier="kv_offload" in replica)
    if "kv_offload" in replica and "speculative" not in replica["scheduler"]:
        # (ranks take a tier with either engine loop; the drafters' rules are the scenario
        # generator's)
        replica["scheduler"]["async_scheduling"] = draw(st.booleans())
    ranked = draw(st.sampled_from(["prefill", "decode", "both"]))
    pools = {}
    for pool in ("prefill", "decode"):
        own = {**replica, "kv_cache": {**replica["kv_cache"]}}
        if pool == "decode" and "speculative" in replica["scheduler"]:
            own.pop("kv_offload", None)
        if pool == "decode" and "hierarchical_cache" in replica["scheduler"]:
            # (SGLang's hierarchical cache on a decode pool: refused, not modelled)
            own["scheduler"] = {key: value for key, value in replica["scheduler"].items()
                                if key != "hierarchical_cache"}
        if ranked not in (pool, "both"):
            own["parallelism"] = {}
            # (no ranks: no all-to-all backend to choose)
            own["latency"] = {key: value for key, value in own["latency"].items()
                              if key != "all2all_backend"}
        if pool == "decode":
            own["kv_cache"]["num_blocks"] += draw(st.integers(0, 50))
        pools[pool] = {"replicas": draw(st.integers(1, 2)), "replica": own}
    data["cluster"] = {
        **pools,
        "link": {"bandwidth_gb_s": draw(st.sampled_from([0.001, 0.1, 50.0])),
                 "latency_s": draw(st.sampled_from([0.0, 1e-3]))},
        "overlap_transfer": draw(st.booleans()),
        "router": {"name": draw(st.sampled_from(["round_robin", "least_kv_load"]))},
        "decode_router": {"name": draw(st.sampled_from(["round_robin", "least_kv_load"]))},
    }
    return data
