"""The golden workloads: seeded request lists and engine settings, the same for every recorder.

A workload is a plain dict (it is stored whole in each fixture, so a test needs nothing else):

    name, engine ("vllm" | "sglang"), seed,
    settings: the engine's own scheduler settings, by the engine's names
        (vLLM: max_num_batched_tokens, max_num_seqs, enable_chunked_prefill,
        long_prefill_token_threshold, enable_prefix_caching, async_scheduling;
        SGLang: chunked_prefill_size, max_running_requests, ...),
    num_gpu_blocks, block_size: the KV cache the engine is given (vLLM keeps one block as its
        null block: `num_gpu_blocks - 1` are usable), max_model_len: the context window,
    step_time: {base_s, per_token_s}: an iteration scheduling n tokens takes
        base_s + per_token_s * n seconds (per_token_s 0: a constant step),
    requests: [arrival_s, num_prompt_tokens, num_output_tokens, prefix_group,
        num_prefix_tokens(, priority)] each, by request id (their index); requests of one
        prefix group share their first num_prefix_tokens prompt tokens (group -1: none
        shared); a sixth entry is the request's priority (vLLM's `scheduling_policy:
        priority` workloads, `settings.scheduling_policy`), else 0.

Token ids are made from these by `prompt_token_ids`, so every recorder and servesim's side
(`tools.golden.replay`) agree on which blocks are shared. No vLLM, SGLang or servesim import.
"""

from __future__ import annotations

from typing import Any

import numpy as np

Workload = dict[str, Any]
VOCAB = 32_000  # the one-layer Llama config's vocabulary (tokens must be below it)


def _requests(rng: np.random.Generator, n: int, rate_per_s: float, prompt: tuple[int, int],
              output: tuple[int, int], *, start_s: float = 0.0) -> list[list[Any]]:
    """`n` Poisson arrivals at `rate_per_s`, lengths uniform in the closed ranges given."""
    gaps = rng.exponential(1.0 / rate_per_s, n)
    arrivals = start_s + np.cumsum(gaps)
    prompts = rng.integers(prompt[0], prompt[1] + 1, n)
    outputs = rng.integers(output[0], output[1] + 1, n)
    # Arrivals rounded to the microsecond: exact in every recorder's and servesim's float sums.
    return [[round(float(t), 6), int(p), int(o), -1, 0]
            for t, p, o in zip(arrivals, prompts, outputs, strict=True)]


def _bursts(rng: np.random.Generator, n: int, burst: tuple[int, int], quiet_s: tuple[float, float],
            prompt: tuple[int, int], output: tuple[int, int]) -> list[list[Any]]:
    """Bursts of a few requests 10 ms apart, separated by quiet periods (a request then runs
    alone)."""
    out: list[list[Any]] = []
    t = 0.0
    while len(out) < n:
        size = int(rng.integers(burst[0], burst[1] + 1))
        for _ in range(min(size, n - len(out))):
            out.append([round(t, 6), int(rng.integers(prompt[0], prompt[1] + 1)),
                        int(rng.integers(output[0], output[1] + 1)), -1, 0])
            t += 0.01
        t += float(rng.uniform(*quiet_s))
    return out


def _prefixed(rng: np.random.Generator, n: int, rate_per_s: float, num_groups: int,
              prefix: tuple[int, int], suffix: tuple[int, int], output: tuple[int, int]
              ) -> list[list[Any]]:
    """Requests sharing one of `num_groups` system prompts (Zipf-like popularity)."""
    prefix_len = rng.integers(prefix[0], prefix[1] + 1, num_groups)
    weights = 1.0 / np.arange(1, num_groups + 1)
    groups = rng.choice(num_groups, n, p=weights / weights.sum())
    reqs = _requests(rng, n, rate_per_s, (0, 0), output)
    for req, g in zip(reqs, groups, strict=True):
        unique = int(rng.integers(suffix[0], suffix[1] + 1))
        req[1] = int(prefix_len[g]) + unique
        req[3], req[4] = int(g), int(prefix_len[g])
    return reqs


def _repeated(rng: np.random.Generator, n: int, num_prompts: int, blocks: tuple[int, int],
              output: tuple[int, int], burst: tuple[int, int], quiet_s: tuple[float, float]
              ) -> list[list[Any]]:
    """Bursts of requests, each repeating one of `num_prompts` whole prompts (of a whole
    number of 16-token blocks), as the public H100 runs' client sends them: a repeat's
    every block may be cached, the last one too."""
    lengths = 16 * rng.integers(blocks[0], blocks[1] + 1, num_prompts)
    reqs = _bursts(rng, n, burst, quiet_s, (0, 0), output)
    for req in reqs:
        k = int(rng.integers(0, num_prompts))
        req[1], req[3], req[4] = int(lengths[k]), k, int(lengths[k])
    return reqs


def _prioritized(rng: np.random.Generator, requests: list[list[Any]], num_levels: int
                 ) -> list[list[Any]]:
    """`requests` each with a priority drawn uniformly from 0 .. num_levels - 1."""
    return _levels(rng, requests, tuple(range(num_levels)))


def _levels(rng: np.random.Generator, requests: list[list[Any]], levels: tuple[int, ...]
            ) -> list[list[Any]]:
    """`requests` each with a priority drawn uniformly from `levels`."""
    drawn = rng.integers(0, len(levels), len(requests))
    return [[*req, levels[int(k)]] for req, k in zip(requests, drawn, strict=True)]


def _vllm(name: str, seed: int, requests: list[list[Any]], *, num_gpu_blocks: int = 20_000,
          step: tuple[float, float] = (0.004, 2e-5), max_model_len: int = 32_768,
          stalls: bool | str = False, block_size: int = 16, only_release: str | None = None,
          **settings: Any) -> Workload:
    base = {"max_num_batched_tokens": 8192, "max_num_seqs": 256, "enable_chunked_prefill": True,
            "long_prefill_token_threshold": 0, "enable_prefix_caching": False,
            "async_scheduling": False}
    # (Set only where it is not FCFS: the fixtures recorded before it stay as they were.)
    unknown = set(settings) - set(base) - {"scheduling_policy", "speculative", "kv_offload"}
    assert not unknown, unknown
    workload = {"name": name, "engine": "vllm", "seed": seed, "settings": {**base, **settings},
                "num_gpu_blocks": num_gpu_blocks, "block_size": block_size,
                "max_model_len": max_model_len,
                "step_time": {"base_s": step[0], "per_token_s": step[1]}, "requests": requests}
    if only_release is not None:  # (recorded with that release only: `record_vllm.main`)
        workload["only_release"] = only_release
    if stalls:  # (the engine waits for ever: the fixture ends there, `record_vllm.record`;
        # a release named: that one only)
        workload["stalls"] = stalls
    return workload


def _spec(method: str, k: int, rate: float | list[float], match_rate: float = 1.0,
          per_batch_size: list[list[int]] | None = None) -> dict[str, Any]:
    """vLLM's speculative config as servesim names it (`speculative`); `match_rate` where an
    n-gram lookup may find no match; `per_batch_size`, 0.33.0's dynamic k."""
    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": k,
                            "acceptance_rate": rate}
    if match_rate != 1.0:
        spec["match_rate"] = match_rate
    if per_batch_size is not None:
        spec["num_speculative_tokens_per_batch_size"] = per_batch_size
    return spec


def _offload(num_cpu_blocks: int, host_bandwidth_gb_s: float,
             eviction_policy: str = "lru", store_threshold: int = 0) -> dict[str, Any]:
    """vLLM's CPU tier (`--kv-offloading-size`): its blocks, and how fast one is copied:
    `bytes_per_block` (a 16-token block of servesim's default model, Llama-3-8B: 2 MiB) over
    the host link, each way; ARC where `eviction_policy` says so, blocks stored from their
    `store_threshold`-th offer (the connector's extra config: recorded with 0.33.0 only,
    `only_release`)."""
    return {"num_cpu_blocks": num_cpu_blocks, "bytes_per_block": 2 * 2**20,
            "host_bandwidth_gb_s": host_bandwidth_gb_s,
            **({"eviction_policy": eviction_policy} if eviction_policy != "lru" else {}),
            **({"store_threshold": store_threshold} if store_threshold else {})}


def vllm_workloads() -> list[Workload]:
    """The vLLM workloads, each of 300 requests, each aimed at one rule."""
    def rng(seed: int) -> np.random.Generator:
        return np.random.default_rng(seed)

    return [
        _vllm("light", 1, _requests(rng(1), 300, 4.0, (32, 1024), (8, 128))),
        _vllm("long_prompts_chunked", 2, _requests(rng(2), 300, 1.5, (4096, 16384), (4, 64)),
              max_num_batched_tokens=2048),
        _vllm("threshold_quiet", 3,
              _bursts(rng(3), 300, (1, 5), (1.0, 3.0), (256, 4096), (4, 32)),
              max_num_batched_tokens=2048, long_prefill_token_threshold=512),
        _vllm("kv_starved", 4, _requests(rng(4), 300, 20.0, (256, 2048), (64, 512)),
              num_gpu_blocks=600),
        _vllm("max_num_seqs", 5, _requests(rng(5), 300, 10.0, (64, 512), (32, 256)),
              max_num_seqs=8),
        _vllm("prefix_eviction", 6,
              _prefixed(rng(6), 300, 8.0, 12, (512, 3000), (16, 512), (8, 64)),
              num_gpu_blocks=800, enable_prefix_caching=True),
        _vllm("prefix_shared", 7,
              _prefixed(rng(7), 300, 6.0, 4, (256, 2048), (16, 512), (8, 64)),
              enable_prefix_caching=True),
        _vllm("async_light", 8, _requests(rng(8), 300, 6.0, (32, 2048), (8, 128)),
              async_scheduling=True),
        _vllm("async_chunked", 9, _requests(rng(9), 300, 3.0, (256, 8192), (4, 96)),
              max_num_batched_tokens=2048, async_scheduling=True),
        _vllm("async_kv_starved", 11, _requests(rng(11), 300, 20.0, (256, 2048), (64, 512)),
              num_gpu_blocks=600, async_scheduling=True),
        _vllm("async_threshold_quiet", 12,
              _bursts(rng(12), 300, (1, 5), (0.5, 2.0), (256, 4096), (4, 48)),
              max_num_batched_tokens=2048, long_prefill_token_threshold=512,
              async_scheduling=True),
        _vllm("kv_starved_prefix_caching", 13,
              _prefixed(rng(13), 300, 16.0, 6, (256, 1024), (64, 1024), (64, 384)),
              num_gpu_blocks=500, enable_prefix_caching=True),
        _vllm("priority_kv_starved", 14,
              _prioritized(rng(114), _requests(rng(14), 300, 20.0, (256, 2048), (64, 512)), 3),
              num_gpu_blocks=600, scheduling_policy="priority"),
        _vllm("priority_queue", 15,
              _prioritized(rng(115), _requests(rng(15), 300, 10.0, (64, 512), (32, 256)), 4),
              max_num_seqs=8, scheduling_policy="priority"),
        _vllm("priority_async_kv_starved", 16,
              _prioritized(rng(116), _requests(rng(16), 300, 20.0, (256, 2048), (64, 512)), 3),
              num_gpu_blocks=600, async_scheduling=True, scheduling_policy="priority"),
        _vllm("priority_chunked_kv_starved", 17,
              _prioritized(rng(117), _requests(rng(17), 300, 6.0, (1024, 8192), (16, 256)), 3),
              num_gpu_blocks=1500, max_num_batched_tokens=2048, scheduling_policy="priority"),
        # Few running, little KV: the request being scheduled is often the lowest priority
        # itself (0.33.0's pass goes on past it, 0.15.1's ends).
        _vllm("priority_self_victim", 18,
              _prioritized(rng(118), _requests(rng(18), 300, 10.0, (256, 1024), (128, 768)), 2),
              num_gpu_blocks=220, max_num_seqs=6, scheduling_policy="priority"),
        # Synchronous and KV-starved: in 0.15.1 the first running request, the lowest
        # priority, preempts itself and ends the pass while others run (an empty step).
        _vllm("priority_sync_empty_step", 19,
              _prioritized(rng(119), _requests(rng(19), 300, 6.0, (64, 1024), (100, 600)), 3),
              num_gpu_blocks=200, max_num_seqs=6, scheduling_policy="priority"),
        # Speculative decoding (rule 18): drafts verified within the budget, accepted at the
        # workload's rates by a draw both sides make (`sim.core.speculative`).
        _vllm("spec_ngram_sync", 20, _requests(rng(20), 300, 6.0, (32, 2048), (8, 200)),
              speculative=_spec("ngram", 3, 0.6)),
        _vllm("spec_eagle_async", 21, _requests(rng(21), 300, 8.0, (32, 2048), (8, 200)),
              async_scheduling=True, speculative=_spec("eagle", 3, 0.7)),
        _vllm("spec_eagle_kv_starved", 22, _requests(rng(22), 300, 20.0, (256, 2048), (64, 512)),
              num_gpu_blocks=600, speculative=_spec("eagle", 4, [0.8, 0.7, 0.6, 0.5])),
        _vllm("spec_eagle_async_kv_starved", 23,
              _requests(rng(23), 300, 20.0, (256, 2048), (64, 512)),
              num_gpu_blocks=600, async_scheduling=True, speculative=_spec("eagle3", 3, 0.75)),
        _vllm("spec_eagle_async_chunked", 24, _requests(rng(24), 300, 4.0, (256, 8192), (4, 160)),
              max_num_batched_tokens=1024, long_prefill_token_threshold=256,
              async_scheduling=True, speculative=_spec("eagle", 5, 0.65)),
        _vllm("spec_eagle_prefix_kv_starved", 25,
              _prefixed(rng(25), 300, 16.0, 6, (256, 1024), (64, 1024), (64, 384)),
              num_gpu_blocks=500, enable_prefix_caching=True,
              speculative=_spec("eagle", 3, 0.7)),
        # Prefix caching under a tight KV cache with a threshold: which blocks a step caches
        # (0.15.1's synchronous scheduler only as it allocates), a last step's drafts trimmed
        # at the output length, 0.15.1's drafts for an unfinished chunk (found by a review).
        _vllm("spec_eagle_prefix_tight", 114,
              _prefixed(rng(114), 300, 16.0, 8, (256, 1024), (16, 256), (64, 384)),
              num_gpu_blocks=300, enable_prefix_caching=True, long_prefill_token_threshold=64,
              max_num_batched_tokens=512, speculative=_spec("eagle", 3, 0.7)),
        _vllm("spec_ngram_prefix_tight", 114,
              _prefixed(rng(114), 300, 16.0, 8, (256, 1024), (16, 256), (64, 384)),
              num_gpu_blocks=300, enable_prefix_caching=True, long_prefill_token_threshold=64,
              max_num_batched_tokens=512, speculative=_spec("ngram", 3, 0.7)),
        _vllm("spec_eagle_async_prefix_tight", 115,
              _prefixed(rng(115), 300, 16.0, 8, (256, 1024), (16, 256), (64, 384)),
              num_gpu_blocks=300, enable_prefix_caching=True, long_prefill_token_threshold=64,
              max_num_batched_tokens=512, async_scheduling=True,
              speculative=_spec("eagle", 3, 0.7)),
        # n-gram lookups that find no match (`match_rate`): synchronous, the next step has no
        # drafts; async (0.33.0), its scheduled placeholders are padding. KV-starved, so that
        # preemptions meet requests with drafts and without.
        _vllm("spec_ngram_nomatch", 27, _requests(rng(27), 300, 20.0, (256, 2048), (64, 512)),
              num_gpu_blocks=600, speculative=_spec("ngram", 3, 0.75, match_rate=0.4)),
        _vllm("spec_ngram_nomatch_async", 28,
              _requests(rng(28), 300, 20.0, (256, 2048), (64, 512)),
              num_gpu_blocks=600, async_scheduling=True,
              speculative=_spec("ngram", 3, 0.75, match_rate=0.4)),
        # 0.33.0's dynamic speculative decoding: k by the step's number of requests (4 up to 4,
        # 2 up to 16, none beyond: no drafter, no padding of a decode from the queue),
        # bursts so that batches cross the ranges; synchronous and async.
        *(_vllm(f"spec_eagle_dynamic{suffix}", 29,
                _bursts(rng(29), 300, (1, 30), (0.2, 3.0), (64, 1024), (16, 256)),
                num_gpu_blocks=2000, async_scheduling=asynchronous,
                speculative=_spec("eagle", 4, 0.7,
                                  per_batch_size=[[1, 4, 4], [5, 16, 2], [17, 256, 0]]))
          for suffix, asynchronous in (("", False), ("_async", True))),
        _vllm("spec_eagle_dynamic_kv_starved", 30,
              _bursts(rng(30), 300, (1, 30), (0.2, 3.0), (256, 2048), (64, 512)),
              num_gpu_blocks=500, async_scheduling=True,
              speculative=_spec("eagle3", 3, 0.75, per_batch_size=[[1, 2, 3], [8, 256, 1]])),
        # A draft model: 0.33.0 keeps one budget slot per request for it.
        _vllm("spec_draft_model_budget", 26, _requests(rng(26), 300, 12.0, (32, 1024), (16, 256)),
              max_num_batched_tokens=384, max_num_seqs=64,
              speculative=_spec("draft_model", 4, 0.5)),
        # The CPU tier (rule 19; recorded with 0.15.1's connector): prefixes evicted from a
        # tight GPU cache come back from the tier; copies fast or slow (loads spanning many
        # steps, a later request waiting for blocks another loads, finished requests' blocks
        # held for their stores); preemptions; a tier too small to take every store.
        _vllm("offload_prefix", 30,
              _prefixed(rng(30), 300, 8.0, 12, (512, 3000), (16, 512), (8, 64)),
              num_gpu_blocks=800, enable_prefix_caching=True, kv_offload=_offload(1024, 25.0)),
        _vllm("offload_prefix_async", 31,
              _prefixed(rng(31), 300, 8.0, 12, (512, 3000), (16, 512), (8, 64)),
              num_gpu_blocks=800, enable_prefix_caching=True, async_scheduling=True,
              kv_offload=_offload(1024, 25.0)),
        _vllm("offload_slow_link", 32,
              _prefixed(rng(32), 300, 10.0, 6, (256, 2048), (16, 256), (8, 96)),
              num_gpu_blocks=500, enable_prefix_caching=True, kv_offload=_offload(768, 1.0)),
        _vllm("offload_slow_link_async", 33,
              _prefixed(rng(33), 300, 10.0, 6, (256, 2048), (16, 256), (8, 96)),
              num_gpu_blocks=500, enable_prefix_caching=True, async_scheduling=True,
              kv_offload=_offload(768, 1.0)),
        _vllm("offload_kv_starved", 34,
              _prefixed(rng(34), 300, 16.0, 6, (256, 1024), (64, 1024), (64, 384)),
              num_gpu_blocks=500, enable_prefix_caching=True, kv_offload=_offload(256, 8.0)),
        _vllm("offload_kv_starved_async", 35,
              _prefixed(rng(35), 300, 16.0, 6, (256, 1024), (64, 1024), (64, 384)),
              num_gpu_blocks=500, enable_prefix_caching=True, async_scheduling=True,
              kv_offload=_offload(256, 8.0)),
        _vllm("offload_repeated_prompts_async", 36,
              _repeated(rng(36), 300, 24, (16, 120), (4, 48), (1, 6), (0.05, 0.6)),
              num_gpu_blocks=400, enable_prefix_caching=True, async_scheduling=True,
              kv_offload=_offload(512, 2.0)),
        _vllm("offload_repeated_prompts", 37,
              _repeated(rng(37), 300, 24, (16, 120), (4, 48), (1, 6), (0.05, 0.6)),
              num_gpu_blocks=400, enable_prefix_caching=True, kv_offload=_offload(512, 2.0)),
        # The CPU tier under the priority policy, KV-starved: loaded requests wait by
        # priority (0.33.0's holding queue is a priority queue too), victims anywhere.
        _vllm("offload_priority_kv_starved", 43,
              _prioritized(rng(143), _prefixed(rng(43), 300, 16.0, 6, (256, 1024),
                                               (64, 1024), (64, 384)), 3),
              num_gpu_blocks=500, enable_prefix_caching=True, scheduling_policy="priority",
              kv_offload=_offload(256, 8.0)),
        _vllm("offload_priority_kv_starved_async", 44,
              _prioritized(rng(144), _prefixed(rng(44), 300, 16.0, 6, (256, 1024),
                                               (64, 1024), (64, 384)), 3),
              num_gpu_blocks=500, enable_prefix_caching=True, scheduling_policy="priority",
              async_scheduling=True, kv_offload=_offload(256, 8.0)),
        # The CPU tier with speculative decoding: drafts in the steps whose full blocks are
        # stored; lookahead slots beside blocks a load fills; prefixes shared under eviction.
        _vllm("offload_spec_eagle", 38,
              _prefixed(rng(38), 300, 10.0, 6, (256, 2048), (16, 256), (8, 200)),
              num_gpu_blocks=500, enable_prefix_caching=True, kv_offload=_offload(768, 4.0),
              speculative=_spec("eagle", 3, 0.7)),
        _vllm("offload_spec_eagle_async", 39,
              _prefixed(rng(39), 300, 10.0, 6, (256, 2048), (16, 256), (8, 200)),
              num_gpu_blocks=500, enable_prefix_caching=True, async_scheduling=True,
              kv_offload=_offload(768, 4.0), speculative=_spec("eagle", 3, 0.7)),
        _vllm("offload_spec_ngram_kv_starved", 40,
              _prefixed(rng(40), 300, 16.0, 6, (256, 1024), (64, 1024), (64, 384)),
              num_gpu_blocks=500, enable_prefix_caching=True, kv_offload=_offload(256, 8.0),
              speculative=_spec("ngram", 3, 0.75, match_rate=0.6)),
        # A draft model with the tier, KV-starved; and n-gram lookups that miss under async
        # scheduling (0.33.0 only: 0.15.1 refuses async n-gram).
        _vllm("offload_spec_draft_model_kv_starved", 46,
              _prefixed(rng(46), 300, 16.0, 6, (256, 1024), (64, 1024), (64, 384)),
              num_gpu_blocks=500, enable_prefix_caching=True, kv_offload=_offload(256, 8.0),
              speculative=_spec("draft_model", 3, 0.6)),
        _vllm("offload_spec_ngram_async_kv_starved", 47,
              _prefixed(rng(47), 300, 16.0, 6, (256, 1024), (64, 1024), (64, 384)),
              num_gpu_blocks=500, enable_prefix_caching=True, async_scheduling=True,
              kv_offload=_offload(256, 8.0),
              speculative=_spec("ngram", 3, 0.75, match_rate=0.6)),
        # Repeated whole prompts with drafters: a request whose KV was loaded but for its last
        # token is padded to 1 + k tokens (0.33.0), a load keeps room for a step with drafts.
        _vllm("offload_spec_ngram_repeated", 48,
              _repeated(rng(48), 300, 24, (16, 120), (4, 48), (1, 6), (0.05, 0.6)),
              num_gpu_blocks=400, enable_prefix_caching=True, kv_offload=_offload(512, 2.0),
              speculative=_spec("ngram", 3, 0.75)),
        _vllm("offload_spec_draft_model_repeated", 49,
              _repeated(rng(49), 300, 24, (16, 120), (4, 48), (1, 6), (0.05, 0.6)),
              num_gpu_blocks=400, enable_prefix_caching=True, kv_offload=_offload(512, 2.0),
              speculative=_spec("draft_model", 3, 0.6)),
        # KV-starved with a threshold: requests whose KV was loaded hold the blocks the
        # queue's head needs, and each needs more to run (their drafter's lookahead among
        # them): vLLM 0.15.1 waits for ever, and servesim says so (`engine_stalled`); 0.33.0
        # admits a load only beside what prefills still need, and runs it to the end.
        _vllm("offload_spec_eagle_kv_starved_stalls", 42,
              _prefixed(rng(42), 300, 16.0, 6, (256, 1024), (64, 1024), (64, 384)),
              num_gpu_blocks=500, enable_prefix_caching=True, kv_offload=_offload(256, 8.0),
              long_prefill_token_threshold=128, speculative=_spec("eagle", 3, 0.7),
              stalls="0.15.1"),
        _vllm("offload_spec_eagle_async_kv_starved", 41,
              _prefixed(rng(41), 300, 16.0, 6, (256, 1024), (64, 1024), (64, 384)),
              num_gpu_blocks=500, enable_prefix_caching=True, async_scheduling=True,
              kv_offload=_offload(256, 8.0), speculative=_spec("eagle3", 3, 0.75)),
        # Short ones found by a review (their fixtures under tests/golden/short/, fewer than
        # 300 requests): a request of the lowest priority preempts itself, and the empty step
        # waits ~2 s for its stores while another request arrives (vLLM plans after the wait);
        # an empty step that preempts while finished requests' frees wait for their stores.
        # A load admitted only if a step with drafts still fits beside it (0.33.0's
        # `_spec_decode_step_blocks`), and beside every prefill's step with drafts.
        _vllm("offload_spec_load_room", 77,
              _repeated(rng(48), 200, 24, (16, 120), (4, 48), (1, 6), (0.05, 0.6)),
              num_gpu_blocks=400, enable_prefix_caching=True, kv_offload=_offload(512, 2.0),
              speculative=_spec("ngram", 3, 0.75)),
        # The tier under ARC (0.33.0: 0.15.1's ARC manager fails at its first store): shared
        # system prompts reused (into T2) beside one-off questions (T1) in a tier that
        # evicts, evicted prefixes coming back (ghost hits moving T1's target); sync, async,
        # KV-starved, and whole prompts repeated in bursts.
        _vllm("offload_arc_prefix", 400,
              _prefixed(rng(400), 300, 8.0, 12, (512, 3000), (16, 512), (8, 64)),
              num_gpu_blocks=800, enable_prefix_caching=True, only_release="0.33.0",
              kv_offload=_offload(512, 25.0, "arc")),
        _vllm("offload_arc_prefix_async", 401,
              _prefixed(rng(401), 300, 8.0, 12, (512, 3000), (16, 512), (8, 64)),
              num_gpu_blocks=800, enable_prefix_caching=True, async_scheduling=True,
              only_release="0.33.0", kv_offload=_offload(512, 25.0, "arc")),
        _vllm("offload_arc_kv_starved", 402,
              _prefixed(rng(402), 300, 16.0, 6, (256, 1024), (64, 1024), (64, 384)),
              num_gpu_blocks=500, enable_prefix_caching=True, only_release="0.33.0",
              kv_offload=_offload(256, 8.0, "arc")),
        _vllm("offload_arc_repeated_prompts", 403,
              _repeated(rng(403), 300, 24, (16, 120), (4, 48), (1, 6), (0.05, 0.6)),
              num_gpu_blocks=400, enable_prefix_caching=True, only_release="0.33.0",
              kv_offload=_offload(384, 2.0, "arc")),
        # Blocks stored only from their second (third) offer (`store_threshold`, 0.33.0):
        # one-off questions never reach the tier, shared prefixes do; sync, async, and
        # repeated whole prompts under ARC.
        _vllm("offload_threshold_prefix", 404,
              _prefixed(rng(404), 300, 8.0, 12, (512, 3000), (16, 512), (8, 64)),
              num_gpu_blocks=800, enable_prefix_caching=True, only_release="0.33.0",
              kv_offload=_offload(512, 25.0, store_threshold=2)),
        _vllm("offload_threshold_prefix_async", 405,
              _prefixed(rng(405), 300, 8.0, 12, (512, 3000), (16, 512), (8, 64)),
              num_gpu_blocks=800, enable_prefix_caching=True, async_scheduling=True,
              only_release="0.33.0", kv_offload=_offload(512, 25.0, store_threshold=2)),
        _vllm("offload_threshold_arc_repeated_prompts", 406,
              _repeated(rng(406), 300, 24, (16, 120), (4, 48), (1, 6), (0.05, 0.6)),
              num_gpu_blocks=400, enable_prefix_caching=True, only_release="0.33.0",
              kv_offload=_offload(384, 2.0, "arc", store_threshold=3)),
        # Blocks of one token (found by held-out workloads, 0.33.0): a one-token prompt whose
        # block the tier holds loads it, has nothing computed after (its token is computed
        # again), is taken for new and asked again, "loads" no block, ... until another
        # request's store evicts the block from the tier.
        _vllm("offload_one_token_reload", 7,
              [[0.0, 2, 20, 0, 2], [0.03, 1, 2, 0, 1], [0.1, 3, 2, -1, 0]],
              num_gpu_blocks=64, step=(0.01, 0.0), max_model_len=256,
              max_num_batched_tokens=256, max_num_seqs=4, enable_prefix_caching=True,
              block_size=1, kv_offload={**_offload(3, 0.1), "bytes_per_block": 2**17}),
        _vllm("offload_self_preempt_waits", 222,
              [[0.0, 111, 100, -1, 0, 2], [0.001, 193, 100, -1, 0, 0], [0.1, 40, 5, -1, 0, 0]],
              num_gpu_blocks=21, enable_prefix_caching=True, scheduling_policy="priority",
              kv_offload=_offload(64, 0.02)),
        _vllm("offload_empty_step_preempts", 221,
              _requests(rng(221), 150, 10.0, (256, 1024), (16, 64)),
              num_gpu_blocks=300, enable_prefix_caching=True, kv_offload=_offload(256, 1.0)),
        # Found by held-out workloads of the tier with speculative decoding (short): a chunk
        # whose drafter lookahead reaches into the next block caches none of it (vLLM caches
        # the tokens scheduled), with and without the tier, and after a preemption; a request
        # finished with a step in flight, its blocks held for its stores, is finished again by
        # that step's output, and the worker told again (an empty step polls).
        *(_vllm(f"spec_lookahead_not_cached{suffix}", 5,
                [[0.0, 3000, 4, 0, 3000], [0.005, 3100, 4, 0, 3000]],
                enable_prefix_caching=True, max_num_batched_tokens=1020,
                long_prefill_token_threshold=510, speculative=_spec("eagle", 5, 0.7),
                **tier)
          for suffix, tier in (("", {}), ("_offload", {"kv_offload": _offload(512, 1.0)}))),
        _vllm("offload_spec_lookahead_preempt", 6,
              [[0.0, 2194, 14, -1, 0], [0.0, 600, 200, -1, 0]],
              num_gpu_blocks=190, enable_prefix_caching=True, max_num_batched_tokens=512,
              long_prefill_token_threshold=506, speculative=_spec("eagle", 5, 0.7),
              kv_offload=_offload(512, 1.0)),
        _vllm("offload_spec_finished_again", 310,
              [[0.0, 485, 10, 0, 471], [1.0, 472, 13, 0, 471]], step=(0.01, 5e-5),
              max_model_len=4096, enable_chunked_prefill=False, max_num_batched_tokens=4096,
              enable_prefix_caching=True, async_scheduling=True,
              speculative=_spec("eagle3", 1, 0.54), kv_offload=_offload(32, 1.0)),
        # Found by held-out workloads of the tier under ARC (short; LRU here): async, a slow
        # host link; a request's allocation hands out blocks that a finished request's
        # pending stores read, so the step's launch waits ~90 ms for them (0.33.0), and a
        # request arriving meanwhile is in the next step vLLM schedules, at once.
        _vllm("offload_blocked_launch_async", 1066,
              [[0.048965, 554, 38, -1, 0], [0.068786, 4178, 2, -1, 0],
               [0.154772, 1382, 17, -1, 0], [0.178315, 3921, 35, -1, 0],
               [0.259882, 1507, 22, -1, 0], [0.273738, 3824, 9, -1, 0],
               [0.328919, 3310, 15, -1, 0], [0.49669, 2698, 53, -1, 0],
               [0.582344, 2597, 38, -1, 0], [0.60546, 2602, 2, -1, 0],
               [0.672759, 3183, 19, -1, 0], [0.719898, 611, 9, -1, 0],
               [0.882242, 627, 49, -1, 0], [1.204833, 3968, 49, -1, 0],
               [1.246823, 2506, 17, -1, 0], [1.443323, 487, 51, -1, 0]],
              num_gpu_blocks=2000, step=(0.002, 1e-5), max_num_batched_tokens=4096,
              enable_prefix_caching=True, async_scheduling=True,
              kv_offload=_offload(2115, 0.5)),
        _vllm("no_chunking_constant_step", 10,
              _requests(rng(10), 300, 12.0, (64, 6000), (8, 64)), step=(0.02, 0.0),
              enable_chunked_prefill=False, max_num_batched_tokens=8192, max_model_len=8192),
    ]


def prompt_token_ids(workload: Workload, request_id: int) -> list[int]:
    """Request `request_id`'s prompt as token ids: its group's shared prefix, then tokens of
    its own (seeded by the workload's seed and the request)."""
    _, num_prompt, _, group, num_prefix = workload["requests"][request_id][:5]
    seed = workload["seed"]
    ids: list[int] = []
    if group >= 0:
        ids += np.random.default_rng([seed, 1, group]).integers(1, VOCAB, num_prefix).tolist()
    ids += np.random.default_rng([seed, 2, request_id]).integers(
        1, VOCAB, num_prompt - len(ids)).tolist()
    return ids


def output_token_id(request_id: int, index: int) -> int:
    """The token a fake model samples for request `request_id`'s `index`-th output: any token
    not ending the request (every request ignores EOS)."""
    return 1 + (request_id * 7919 + index * 104_729) % (VOCAB - 1)


WORKLOADS = {w["name"]: w for w in vllm_workloads()}
