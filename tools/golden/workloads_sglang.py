"""The SGLang golden workloads (`tools/golden/record_sglang.py` records them).

Same dict format as `workloads.py` (see its docstring), with `engine` "sglang" and `settings`
holding SGLang server arguments by SGLang's names:

    chunked_prefill_size, max_running_requests, disable_radix_cache (bool),
    schedule_policy ("fcfs"), disable_overlap_schedule (bool: true drives SGLang's
    event_loop_normal, false its overlap scheduler, event_loop_overlap),

and `num_gpu_blocks` the KV token pool (`--max-total-tokens`, SGLang's max_total_num_tokens:
every one of those token slots is usable, no null slot), `block_size` SGLang's `--page-size`
(1, or 16 and 64 for the `page*` workloads: the pool is then in tokens still, a multiple of the
page).
Each workload has 40-80 requests: the recorder runs SGLang's real model forward on a CPU,
about 0.05-0.4 s a step. No SGLang or servesim import.

The speculative-decoding workloads (`SGLANG_SPEC_WORKLOADS`, recorded by
`record_sglang_spec.py`) add `settings.speculative` = {algorithm (SGLang's name: EAGLE,
EAGLE3, STANDALONE, NGRAM), num_steps, eagle_topk, num_draft_tokens, acceptance_rate} and
`settings.unset`, the SGLang arguments the recorder leaves for SGLang to pick (the workload
holds what SGLang picks, checked when recording); `SGLANG_SPEC_HICACHE_WORKLOADS` the
hierarchical cache's settings too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tools.golden.workloads import Workload, _bursts, _levels, _prefixed, _repeated, _requests

# HiCache (`_sglang_hicache`): SGLang's arguments, and the recorder's `hicache_transfer`.
# `temperature`: the requests' sampling temperature (default 0, greedy).
HICACHE_KEYS = {"enable_hierarchical_cache", "hicache_ratio", "hicache_write_policy",
                "hicache_mem_layout", "hicache_transfer", "hicache_host_bandwidth_gb_s",
                "temperature"}


def _sglang(name: str, seed: int, requests: list[list[Any]], *, num_gpu_blocks: int = 200_000,
            step: tuple[float, float] = (0.004, 2e-5), max_model_len: int = 32_768,
            page_size: int = 1, **settings: Any) -> Workload:
    base = {"chunked_prefill_size": 8192, "max_running_requests": 256,
            "disable_radix_cache": True, "schedule_policy": "fcfs",
            "disable_overlap_schedule": True}
    priority = {"enable_priority_scheduling", "schedule_low_priority_values_first",
                "priority_scheduling_preemption_threshold", "disable_priority_preemption"}
    unknown = set(settings) - set(base) - priority - HICACHE_KEYS - {"ignore_eos"}
    assert not unknown, unknown
    # (SGLang floors its pool to whole pages and asks for chunks of whole pages.)
    assert num_gpu_blocks % page_size == 0, (num_gpu_blocks, page_size)
    assert {**base, **settings}["chunked_prefill_size"] % page_size == 0, page_size
    return {"name": name, "engine": "sglang", "seed": seed, "settings": {**base, **settings},
            "num_gpu_blocks": num_gpu_blocks, "block_size": page_size,
            "max_model_len": max_model_len,
            "step_time": {"base_s": step[0], "per_token_s": step[1]}, "requests": requests}


def sglang_workloads() -> list[Workload]:
    """The SGLang workloads, each aimed at one rule."""
    def rng(seed: int) -> np.random.Generator:
        return np.random.default_rng(seed)

    return [
        # Little queueing: prefill-before-decode, prefill batches of whatever has arrived.
        _sglang("light", 101, _requests(rng(101), 60, 4.0, (32, 1024), (8, 96))),
        # Prompts longer than the chunk: one chunked request at a time, continued first.
        _sglang("long_prompts_chunked", 102,
                _requests(rng(102), 40, 2.0, (1024, 4096), (4, 48)),
                chunked_prefill_size=1024),
        # Bursts with chunking: several requests share one prefill budget, the last chunked.
        _sglang("bursts_chunked", 103,
                _bursts(rng(103), 50, (2, 6), (0.3, 1.0), (128, 2048), (4, 40)),
                chunked_prefill_size=512),
        # A small token pool: PrefillAdder's admission (the whole output of every ignore_eos
        # request reserved, the "everyone finishes in order" check) holds requests back.
        _sglang("kv_starved", 104, _requests(rng(104), 60, 20.0, (128, 768), (32, 256)),
                num_gpu_blocks=3000),
        # A small pool and small chunks: a chunked request reserves no output until its last
        # chunk, and a continuing chunk takes KV even beyond the reservations
        # (PrefillBudget.available_chunk_tokens), so decodes can run out: retract_decode.
        _sglang("kv_starved_chunked", 108,
                _requests(rng(108), 60, 20.0, (128, 1024), (32, 256)),
                num_gpu_blocks=3000, chunked_prefill_size=256),
        # max_running_requests binding.
        _sglang("max_running_requests", 105,
                _requests(rng(105), 60, 10.0, (64, 512), (16, 128)),
                max_running_requests=6),
        # Shared system prompts, radix cache on (ignore_eos requests then take the general
        # add_one_req path).
        _sglang("prefix_shared", 106,
                _prefixed(rng(106), 60, 6.0, 4, (256, 1536), (16, 256), (8, 48)),
                disable_radix_cache=False),
        # Shared prefixes, radix cache on, a small pool: cached prefixes are evicted.
        _sglang("prefix_kv_starved", 107,
                _prefixed(rng(107), 60, 15.0, 6, (256, 1024), (16, 256), (16, 128)),
                num_gpu_blocks=4000, disable_radix_cache=False),
        # The radix cache under eviction with chunks: a chunk is inserted when the next batch
        # is built (`stash_chunked_request`), a prompt when its prefill ends.
        _sglang("prefix_kv_starved_chunked", 108,
                _prefixed(rng(108), 60, 15.0, 6, (256, 2048), (16, 512), (16, 128)),
                num_gpu_blocks=4000, chunked_prefill_size=512, disable_radix_cache=False),
        # Outputs of a token or a few: requests finish in their prefill batch, which clears
        # the full-batch latch (`last_batch.filter_batch`); the radix cache holds their KV.
        _sglang("short_outputs", 109, _requests(rng(109), 60, 20.0, (128, 1536), (1, 6)),
                num_gpu_blocks=3000, chunked_prefill_size=1024, disable_radix_cache=False),
        # The overlap scheduler (SGLang's default): batch k is scheduled while batch k-1 runs
        # and runs from its end; k-1's result is processed after k is launched.
        # Little queueing: the one-step lag between a batch and its result.
        _sglang("overlap_light", 111, _requests(rng(111), 60, 4.0, (32, 1024), (8, 96)),
                disable_overlap_schedule=False),
        # Prompts longer than the chunk: the next chunk is scheduled before the last one's
        # result is processed.
        _sglang("overlap_chunked", 112,
                _requests(rng(112), 50, 2.0, (1024, 4096), (4, 48)),
                chunked_prefill_size=1024, disable_overlap_schedule=False),
        # A small token pool, radix cache off: admission with one result still in flight
        # (output_ids one token behind), requests finishing in flight left out.
        _sglang("overlap_kv_starved", 114,
                _requests(rng(114), 60, 20.0, (128, 768), (32, 256)),
                num_gpu_blocks=3000, disable_overlap_schedule=False),
        # A small pool and small chunks: continuing chunks taking KV beyond the reservations
        # with one result in flight (as recorded, no request is retracted).
        _sglang("overlap_kv_starved_chunked", 118,
                _requests(rng(118), 60, 20.0, (128, 1024), (32, 256)),
                num_gpu_blocks=3000, chunked_prefill_size=256, disable_overlap_schedule=False),
        # The radix cache under eviction with the overlap loop: insertions and releases one
        # batch later, matches of the batch after.
        _sglang("overlap_prefix_kv_starved", 116,
                _prefixed(rng(116), 60, 15.0, 6, (256, 1024), (16, 256), (16, 128)),
                num_gpu_blocks=4000, disable_radix_cache=False, disable_overlap_schedule=False),
        # max_running_requests binding: a request finishing in flight still holds its slot
        # when the next batch is scheduled.
        _sglang("overlap_max_running_requests", 115,
                _requests(rng(115), 60, 10.0, (64, 512), (16, 128)),
                max_running_requests=6, disable_overlap_schedule=False),
        # --enable-priority-scheduling: the queue by priority (higher first), then by when
        # each request (re)entered it. Levels closer than the preemption threshold (10): no
        # preemption, a queue held back by max_running_requests.
        _sglang("priority_queue", 121,
                _levels(rng(121), _requests(rng(121), 60, 20.0, (64, 512), (32, 256)),
                        (0, 3, 7)),
                max_running_requests=4, enable_priority_scheduling=True),
        # Levels 20 apart: a waiting request preempts running ones of a level 20 or 40 below
        # when the batch is full by count (the lowest level, the latest to enter first; as
        # many as its tokens need), and they go back to the queue's end of their level.
        _sglang("priority_preempt", 122,
                _levels(rng(122), _requests(rng(122), 60, 20.0, (64, 512), (32, 256)),
                        (0, 20, 40)),
                max_running_requests=4, enable_priority_scheduling=True),
        # The same with the overlap loop (SGLang's default).
        _sglang("priority_preempt_overlap", 123,
                _levels(rng(123), _requests(rng(123), 60, 20.0, (64, 512), (32, 256)),
                        (0, 20, 40)),
                max_running_requests=4, enable_priority_scheduling=True,
                disable_overlap_schedule=False),
        # Low values first, threshold 0 (a level apart suffices); chunked prompts.
        _sglang("priority_low_first_chunked", 124,
                _levels(rng(124), _requests(rng(124), 60, 10.0, (128, 2048), (16, 128)),
                        (0, 1, 2)),
                max_running_requests=6, chunked_prefill_size=512,
                enable_priority_scheduling=True, schedule_low_priority_values_first=True,
                priority_scheduling_preemption_threshold=0),
        # A small pool as well: admission refused for tokens (no preemption for that), and
        # preemption when the batch is full by count, the victims' outputs left against the
        # request's need. (Seeds whose preemptions take one victim each: SGLang re-queues
        # the victims of one preemption in a set's order, which nothing reproduces.)
        _sglang("priority_kv_starved", 136,
                _levels(rng(136), _requests(rng(136), 60, 20.0, (128, 768), (32, 256)),
                        (0, 20, 40)),
                num_gpu_blocks=3000, max_running_requests=4, enable_priority_scheduling=True),
        # The same with the overlap loop.
        _sglang("priority_kv_starved_overlap", 127,
                _levels(rng(127), _requests(rng(127), 60, 20.0, (128, 768), (32, 256)),
                        (0, 20, 40)),
                num_gpu_blocks=3000, max_running_requests=4, enable_priority_scheduling=True,
                disable_overlap_schedule=False),
        # Every request a level of its own, 11 apart, a small pool: preemptions of two to four
        # victims at once, of different levels (so their order back in the queue is SGLang's
        # too), each taken for its outputs left against the request's need. (Recorded by a
        # review session.)
        _sglang("priority_distinct_levels", 411,
                [[*r, int(p)] for r, p in zip(_requests(rng(411), 30, 20.0, (16, 64), (60, 250)),
                                              rng(412).permutation(30) * 11, strict=True)],
                num_gpu_blocks=900, max_running_requests=4, enable_priority_scheduling=True),
        *sglang_eos_workloads(rng),
    ]


def sglang_eos_workloads(rng: Any) -> list[Workload]:
    """Requests without ignore_eos (`settings.ignore_eos` false: vllm bench serve's and
    sglang.bench_serving's default): admission reserves a running request's outputs left
    times new_token_ratio (0.7 at first, decaying each decode step to 0.098, set after a
    retraction, reset when the scheduler idles) and takes the general add_one_req path even
    without a radix cache; small pools, so it over-admits and decodes run out:
    retract_decode. (The recorder's model has no EOS: each runs to its output length.)"""
    return [
        _sglang("eos_kv_starved", 601, _requests(rng(601), 50, 20.0, (128, 768), (64, 400)),
                num_gpu_blocks=3000, ignore_eos=False),
        _sglang("eos_overlap_kv_starved", 602,
                _requests(rng(602), 50, 20.0, (128, 768), (64, 400)),
                num_gpu_blocks=3000, disable_overlap_schedule=False, ignore_eos=False),
        # Chunks: a continuing chunk takes KV beyond the reservations.
        _sglang("eos_kv_starved_chunked", 603,
                _requests(rng(603), 40, 20.0, (128, 1024), (32, 300)),
                num_gpu_blocks=2000, chunked_prefill_size=256, ignore_eos=False),
        # The radix cache on: shared prefixes evicted, by the memory check and retractions too.
        _sglang("eos_prefix_kv_starved", 612,
                _prefixed(rng(612), 40, 20.0, 6, (128, 512), (16, 128), (64, 300)),
                num_gpu_blocks=2000, disable_radix_cache=False, ignore_eos=False),
        _sglang("eos_overlap_prefix_kv_starved", 606,
                _prefixed(rng(606), 40, 15.0, 6, (256, 1024), (16, 256), (32, 250)),
                num_gpu_blocks=2500, disable_radix_cache=False, disable_overlap_schedule=False,
                ignore_eos=False),
        # Bursts with quiet spells, each burst more than the pool holds: the scheduler idles
        # between them and the ratio is reset (servesim without the reset differs).
        _sglang("eos_bursts_idle", 633,
                _bursts(rng(633), 40, (6, 10), (3.0, 5.0), (128, 512), (64, 200)),
                num_gpu_blocks=1500, ignore_eos=False),
        _sglang("eos_overlap_bursts_idle", 633,
                _bursts(rng(633), 40, (6, 10), (3.0, 5.0), (128, 512), (64, 200)),
                num_gpu_blocks=1500, disable_overlap_schedule=False, ignore_eos=False),
    ]


def sglang_paged_workloads() -> list[Workload]:
    """Workloads with pages of 16 and 64 tokens (`--page-size`), each the page-1 workload of
    the same rule again, its pool rounded up to whole pages of 64 (3008 and 4032 tokens)."""
    def rng(seed: int) -> np.random.Generator:
        return np.random.default_rng(seed)

    def starved(name: str, page: int, seed: int, chunk: int = 8192, **kw: Any) -> Workload:
        return _sglang(name, seed, _requests(rng(seed), 60, 20.0, (128, 768 if chunk > 256
                                                                   else 1024), (32, 256)),
                       num_gpu_blocks=3008, chunked_prefill_size=chunk, page_size=page, **kw)

    def prefixed(name: str, page: int, seed: int, **kw: Any) -> Workload:
        return _sglang(name, seed,
                       _prefixed(rng(seed), 60, 15.0, 6, (256, 2048), (16, 512), (16, 128)),
                       num_gpu_blocks=4032, chunked_prefill_size=512,
                       disable_radix_cache=False, page_size=page, **kw)
    return [
        # Little queueing: pages only round what admission reserves.
        _sglang("page16_light", 101, _requests(rng(101), 60, 4.0, (32, 1024), (8, 96)),
                page_size=16),
        # A small pool, radix cache off: the in-order check with paged prompts, a decode
        # taking a page only when it starts one.
        starved("page16_kv_starved", 16, 104),
        starved("page64_kv_starved", 64, 104),
        # Small chunks: a chunk (not page-aligned without the radix cache) and its pages.
        starved("page16_kv_starved_chunked", 16, 108, chunk=256),
        starved("page64_kv_starved_chunked", 64, 108, chunk=256),
        # The overlap loop on a small pool.
        starved("page16_overlap_kv_starved", 16, 114, disable_overlap_schedule=False),
        # max_running_requests binding.
        _sglang("page16_max_running_requests", 105,
                _requests(rng(105), 60, 10.0, (64, 512), (16, 128)),
                max_running_requests=6, page_size=16),
        # Shared system prompts, the radix cache on: hits of whole pages only.
        _sglang("page16_prefix_shared", 106,
                _prefixed(rng(106), 60, 6.0, 4, (256, 1536), (16, 256), (8, 48)),
                disable_radix_cache=False, page_size=16),
        # The radix cache under eviction with chunks: page-aligned chunk ends, evictions for
        # a page more per request of a batch.
        prefixed("page16_prefix_kv_starved_chunked", 16, 108),
        prefixed("page64_prefix_kv_starved_chunked", 64, 108),
        prefixed("page64_overlap_prefix_kv_starved_chunked", 64, 116,
                 disable_overlap_schedule=False),
    ]


def sglang_one_token_chunk_workloads() -> list[Workload]:
    """Extends whose last chunk is one token, without speculative decoding (chunks of 16 or
    64). A request computed again after a retraction or a priority preemption extends its
    prompt and outputs: where its chunks leave it one token, SGLang extends that token as
    its chunked request's last, in a prefill batch, and samples there (servesim's
    `SGLang._prefilling`; `Request.is_decoding` reads such a request as decoding). Small:
    8-20 requests, 90-610 steps."""
    def rng(seed: int) -> np.random.Generator:
        return np.random.default_rng(seed)

    def levels(seed: int, n: int) -> list[list[Any]]:
        g = rng(seed)  # (one generator: the lengths, then the levels)
        return _levels(g, _requests(g, n, 20.0, (32, 160), (16, 120)), (0, 20, 40))

    # Prompts of k x 64 + 1 tokens (ignore_eos): alone (64, 64, 1), two sharing a budget
    # (64 | 36 + 28 | 64 | 1 beside the next prompt's first chunk), decodes waiting
    # through chunks of 64 x 3 + 1 and 64 x 4 + 1.
    fresh = [[0.0, 129, 8, -1, 0], [0.2, 100, 24, -1, 0], [0.2, 93, 24, -1, 0],
             [0.21, 65, 16, -1, 0], [0.5, 40, 40, -1, 0], [0.52, 193, 8, -1, 0],
             [0.8, 257, 4, -1, 0], [0.8, 2, 4, -1, 0]]
    return [
        _sglang("one_token_chunk", 0, fresh, chunked_prefill_size=64),
        _sglang("one_token_chunk_overlap", 0, fresh, chunked_prefill_size=64,
                disable_overlap_schedule=False),
        # Without ignore_eos, a pool of 500 and chunks of 16: `retract_decode` retracts a
        # request whose prompt and outputs come to 16k + 1 tokens.
        _sglang("eos_one_token_chunk", 2, _requests(rng(2), 15, 20.0, (32, 160), (16, 120)),
                num_gpu_blocks=500, chunked_prefill_size=16, max_running_requests=64,
                ignore_eos=False),
        _sglang("eos_overlap_one_token_chunk", 56,
                _requests(rng(56), 15, 20.0, (32, 160), (16, 120)),
                num_gpu_blocks=500, chunked_prefill_size=16, max_running_requests=64,
                ignore_eos=False,
                disable_overlap_schedule=False),
        # ignore_eos, levels 20 apart, chunks of 16: priority preemptions whose victims
        # (prompt and outputs) come to 16k + 1 tokens.
        _sglang("priority_one_token_chunk", 0, levels(0, 20), chunked_prefill_size=16,
                max_running_requests=4, enable_priority_scheduling=True),
        _sglang("priority_overlap_one_token_chunk", 24, levels(24, 12),
                chunked_prefill_size=16, max_running_requests=6,
                enable_priority_scheduling=True, disable_overlap_schedule=False),
    ]


SGLANG_WORKLOADS = {w["name"]: w for w in sglang_workloads() + sglang_paged_workloads()
                    + sglang_one_token_chunk_workloads()}


# SGLang arguments a speculative workload may leave unset (`settings.unset`): SGLang resolves
# them (`arg_groups/speculative_hook.py`) and the workload holds what it resolves them to.
SPEC_UNSETTABLE = ("max_running_requests", "speculative_num_steps", "speculative_eagle_topk",
                   "speculative_num_draft_tokens")


def _sglang_spec(name: str, seed: int, requests: list[list[Any]], *, algorithm: str,
                 num_steps: int, eagle_topk: int, num_draft_tokens: int,
                 acceptance_rate: float = 0.7, unset: tuple[str, ...] = (),
                 **kwargs: Any) -> Workload:
    """An SGLang workload with `--speculative-algorithm` (SGLang's name: EAGLE, EAGLE3,
    STANDALONE, NGRAM) and its numbers, and the chance each draft is accepted given the ones
    before it (over num_steps positions for the EAGLE family, num_draft_tokens - 1 for NGRAM;
    `tools/golden/record_sglang_spec.py` draws it as servesim does)."""
    assert set(unset) <= set(SPEC_UNSETTABLE), unset
    workload = _sglang(name, seed, requests, **kwargs)
    workload["settings"]["speculative"] = {
        "algorithm": algorithm, "num_steps": num_steps, "eagle_topk": eagle_topk,
        "num_draft_tokens": num_draft_tokens, "acceptance_rate": acceptance_rate}
    if unset:
        workload["settings"]["unset"] = sorted(unset)
    return workload


def _numbers(algorithm: str, num_steps: int, eagle_topk: int, num_draft_tokens: int
             ) -> dict[str, Any]:
    return {"algorithm": algorithm, "num_steps": num_steps, "eagle_topk": eagle_topk,
            "num_draft_tokens": num_draft_tokens}


def sglang_spec_workloads() -> list[Workload]:
    """The speculative-decoding workloads (`record_sglang_spec.py` records them), 20-60
    requests each. Small pools: at each decode step a request tops its KV up to its committed
    tokens + 2 * max(steps * topk, draft tokens) (`eagle_prepare_for_decode`), which admission
    does not count, so requests with few outputs left run the pool out and are retracted."""
    def rng(seed: int) -> np.random.Generator:
        return np.random.default_rng(seed)

    spec_args = SPEC_UNSETTABLE[1:]
    ngram = {**_numbers("NGRAM", 1, 10, 12), "unset": spec_args}
    eagle, tree = _numbers("EAGLE", 3, 1, 4), _numbers("EAGLE", 3, 2, 6)

    def on_prefixes(name: str, seed: int, **spec: Any) -> Workload:
        """Shared system prompts in a pool they overflow, the radix cache on."""
        return _sglang_spec(name, seed,
                            _prefixed(rng(seed), 40, 30.0, 6, (128, 512), (16, 128), (8, 64)),
                            num_gpu_blocks=1500, chunked_prefill_size=512,
                            max_running_requests=64, disable_radix_cache=False, **spec)
    overlap: dict[str, Any] = {"disable_overlap_schedule": False}
    return [
        # NGRAM with SGLang's own numbers (breadth 10, 12 tokens verified, S = 12 // 10):
        # every request drafts a chain of 11 (the recorder's proposer), accepting up to 11.
        _sglang_spec("spec_ngram", 510, _requests(rng(510), 20, 200.0, (64, 256), (2, 32)),
                     num_gpu_blocks=700, chunked_prefill_size=128, **ngram),
        _sglang_spec("spec_ngram_overlap", 510,
                     _requests(rng(510), 20, 200.0, (64, 256), (2, 32)),
                     num_gpu_blocks=700, chunked_prefill_size=128, **ngram, **overlap),
        # EAGLE, a chain of 3: prompts of 2-6 chunks of 64, few outputs, a tight pool:
        # retractions (fewest outputs first, the longest prompt among equals), each retracted
        # request back at the queue's end.
        _sglang_spec("spec_eagle_retract", 126,
                     _requests(rng(126), 50, 200.0, (128, 384), (4, 8)),
                     num_gpu_blocks=800, chunked_prefill_size=64, max_running_requests=64,
                     **eagle),
        _sglang_spec("spec_eagle_retract_overlap", 126,
                     _requests(rng(126), 50, 200.0, (128, 384), (4, 8)),
                     num_gpu_blocks=1000, chunked_prefill_size=64, max_running_requests=64,
                     **eagle, **overlap),
        # EAGLE3 (its draft reads three of the target's layers' hidden states), the same
        # scheduling as EAGLE's.
        _sglang_spec("spec_eagle3_retract", 41,
                     _requests(rng(41), 40, 200.0, (128, 384), (4, 8)),
                     num_gpu_blocks=900, chunked_prefill_size=64, max_running_requests=64,
                     **{**eagle, "algorithm": "EAGLE3"}),
        # EAGLE with a tree (2 branches a pass, 3 passes, 6 tokens verified): a verify accepts
        # at most 3 (a path's depth) of its 5 drafts; the top-up is 2 * 6 slots.
        _sglang_spec("spec_eagle_tree", 546, _requests(rng(546), 30, 50.0, (64, 384), (4, 16)),
                     num_gpu_blocks=700, chunked_prefill_size=128, max_running_requests=64,
                     **tree),
        _sglang_spec("spec_eagle_tree_overlap", 544,
                     _requests(rng(544), 30, 50.0, (64, 384), (4, 16)),
                     num_gpu_blocks=700, chunked_prefill_size=128, max_running_requests=64,
                     **tree, **overlap),
        # EAGLE with nothing set but the draft model: SGLang's choice for a Llama, 5 steps of
        # 4 branches, 8 tokens verified (a top-up of 2 * 20 slots), and max_running_requests
        # reset to 48 (a burst of 60: the cap binds); the overlap loop, SGLang's default.
        _sglang_spec("spec_eagle_auto_overlap", 542,
                     _requests(rng(542), 60, 500.0, (32, 256), (16, 64)),
                     num_gpu_blocks=9000, chunked_prefill_size=1024, max_running_requests=48,
                     algorithm="EAGLE", num_steps=5, eagle_topk=4, num_draft_tokens=8,
                     unset=SPEC_UNSETTABLE, **overlap),
        # A standalone draft model (a one-layer Llama), SGLang's numbers for it: (3, 1, 4).
        _sglang_spec("spec_standalone_overlap", 37,
                     _requests(rng(37), 40, 200.0, (128, 384), (4, 8)),
                     num_gpu_blocks=1200, chunked_prefill_size=64, max_running_requests=64,
                     algorithm="STANDALONE", num_steps=3, eagle_topk=1, num_draft_tokens=4,
                     unset=spec_args, **overlap),
        # A pool 4 slots above the largest request (375 + 6 tokens): SGLang admits it
        # (admission counts its prompt, its outputs and 2 spare slots, not the decode
        # step's top-up) and, once its KV + 2 * 4 slots exceed the pool, `retract_decode`
        # aborts it, the last request of its batch ("Out of memory even after retracting all
        # other requests"), counting a retraction; the synchronous loop and the overlap one.
        _sglang_spec("spec_eagle_abort", 12,
                     _requests(np.random.default_rng(12), 30, 20.0, (64, 384), (4, 32)),
                     num_gpu_blocks=384, chunked_prefill_size=128, max_running_requests=64,
                     **eagle),
        _sglang_spec("spec_eagle_abort_overlap", 12,
                     _requests(np.random.default_rng(12), 30, 20.0, (64, 384), (4, 32)),
                     num_gpu_blocks=384, chunked_prefill_size=128, max_running_requests=64,
                     **eagle, **overlap),
        # The radix cache on (EAGLE keys it by token pairs, NGRAM by tokens): shared system
        # prompts in a pool they overflow, so cached prefixes are matched and evicted (LRU).
        on_prefixes("spec_eagle_prefix", 601, **eagle),
        on_prefixes("spec_eagle_prefix_overlap", 601, **eagle, **overlap),
        # Short suffixes and outputs on three cached prefixes, a tight pool, chunks of 64: many
        # requests decode at once, their top-ups outrun admission and `retract_decode`
        # retracts (after evicting what the tree can spare; a retraction unlocks its prefix).
        _sglang_spec("spec_eagle_prefix_retract", 664,
                     _prefixed(rng(664), 60, 200.0, 3, (96, 160), (4, 24), (2, 6)),
                     num_gpu_blocks=350, chunked_prefill_size=64, max_running_requests=64,
                     disable_radix_cache=False, **eagle),
        # Whole prompts repeated in bursts: a cached repeat extends 2 tokens (its L - 1 token
        # pairs cached, the match capped below them), others miss after evictions.
        _sglang_spec("spec_eagle_repeat", 681,
                     _repeated(rng(681), 40, 8, (8, 24), (8, 48), (1, 6), (0.05, 0.6)),
                     num_gpu_blocks=1000, chunked_prefill_size=512, max_running_requests=64,
                     disable_radix_cache=False, **eagle),
        # NGRAM (SGLang's numbers, a top-up of 2 * 12 slots) on shared prefixes, radix on.
        on_prefixes("spec_ngram_prefix", 691, **ngram),
        # An EAGLE tree (3, 2, 6) on shared prefixes with the overlap loop: insertions and
        # frees one batch late, evictions under the tree's larger top-up.
        on_prefixes("spec_eagle_tree_prefix_overlap", 701, **tree, **overlap),
        # Small pools where SGLang's eager evictions decide (found by comparing servesim with
        # and without them on random workloads): `check_decode_mem` evicts what the top-ups
        # are short of before it retracts, and each retraction evicts room for 20 tokens per
        # request kept, a retracted request's own cached prompt included.
        _sglang_spec("spec_eagle_retract_evicts", 144,
                     _prefixed(rng(144), 9, 20.0, 3, (16, 64), (1, 32), (1, 28)),
                     num_gpu_blocks=123, chunked_prefill_size=512, max_running_requests=32,
                     disable_radix_cache=False, acceptance_rate=1.0,
                     **_numbers("EAGLE", 2, 1, 3)),
        _sglang_spec("spec_eagle_retract_evicts_small", 330,
                     _prefixed(rng(330), 3, 20.0, 3, (16, 64), (1, 32), (1, 23)),
                     num_gpu_blocks=92, chunked_prefill_size=512, max_running_requests=32,
                     disable_radix_cache=False, acceptance_rate=1.0, **eagle),
        # Requests retracted twice: the extend that computes a retracted request's prompt and
        # outputs again inserts them all (`checkpoint_kv_cache` up to `extend_end`), so the
        # next time it finds its outputs cached too (and the evictions above).
        _sglang_spec("spec_ngram_retract_again", 1049,
                     _prefixed(rng(1049), 6, 20.0, 1, (16, 64), (1, 32), (1, 26)),
                     num_gpu_blocks=160, chunked_prefill_size=512, max_running_requests=32,
                     disable_radix_cache=False, acceptance_rate=0.5, **ngram),
        _sglang_spec("spec_ngram_retract_again_rejected", 77,
                     _prefixed(rng(77), 4, 20.0, 3, (16, 64), (1, 32), (1, 21)),
                     num_gpu_blocks=106, chunked_prefill_size=512, max_running_requests=32,
                     disable_radix_cache=False, acceptance_rate=0.0, **ngram),
    ]


def sglang_spec_eos_workloads() -> list[Workload]:
    """Speculative decoding with requests without ignore_eos (`settings.ignore_eos` false, as
    the `eos_*` workloads): admission reserves a running request's outputs left times
    new_token_ratio and takes the general add_one_req path; under small pools the decode
    step's top-ups (2L slots a request, which admission does not count) and the decaying
    ratio over-admit, and `retract_decode` retracts, setting the ratio. (The recorder's model
    has no EOS: each request runs to its output length.)"""
    def rng(seed: int) -> np.random.Generator:
        return np.random.default_rng(seed)

    ngram = {**_numbers("NGRAM", 1, 10, 12), "unset": SPEC_UNSETTABLE[1:]}
    eagle = _numbers("EAGLE", 3, 1, 4)
    overlap: dict[str, Any] = {"disable_overlap_schedule": False}
    eos: dict[str, Any] = {"ignore_eos": False, "max_running_requests": 64,
                           "chunked_prefill_size": 512}
    return [
        # EAGLE (3, 1, 4) and NGRAM (SGLang's numbers: a top-up of 2 * 12 slots): 30 requests
        # with outputs of 100-400 tokens on a pool of 800, each with the synchronous loop and
        # the overlap one.
        _sglang_spec("spec_eos_eagle_kv_starved", 901,
                     _requests(rng(901), 30, 20.0, (64, 192), (100, 400)),
                     num_gpu_blocks=800, **eagle, **eos),
        _sglang_spec("spec_eos_eagle_overlap_kv_starved", 901,
                     _requests(rng(901), 30, 20.0, (64, 192), (100, 400)),
                     num_gpu_blocks=800, **eagle, **eos, **overlap),
        _sglang_spec("spec_eos_ngram_kv_starved", 911,
                     _requests(rng(911), 30, 20.0, (64, 192), (100, 400)),
                     num_gpu_blocks=800, **ngram, **eos),
        _sglang_spec("spec_eos_ngram_overlap_kv_starved", 911,
                     _requests(rng(911), 30, 20.0, (64, 192), (100, 400)),
                     num_gpu_blocks=800, **ngram, **eos, **overlap),
        # The radix cache on: four shared system prompts, evicted by admission, the memory
        # check and retractions.
        _sglang_spec("spec_eos_eagle_prefix_kv_starved", 903,
                     _prefixed(rng(903), 30, 20.0, 4, (64, 256), (16, 64), (100, 400)),
                     num_gpu_blocks=800, disable_radix_cache=False, **eagle, **eos),
        # Bursts with quiet spells: the scheduler idles between them and the ratio is reset.
        _sglang_spec("spec_eos_eagle_bursts_idle", 903,
                     _bursts(rng(903), 30, (6, 10), (3.0, 5.0), (64, 192), (100, 300)),
                     num_gpu_blocks=800, **eagle, **eos),
        # An EAGLE tree (3, 2, 6: a top-up of 2 * 6 slots) on shared prefixes with the overlap
        # loop.
        _sglang_spec("spec_eos_eagle_tree_prefix_overlap", 915,
                     _prefixed(rng(915), 30, 20.0, 4, (64, 256), (16, 64), (100, 400)),
                     num_gpu_blocks=800, disable_radix_cache=False,
                     **_numbers("EAGLE", 3, 2, 6), **eos, **overlap),
        # NGRAM with chunks of 64: prompts of 2-6 chunks, a continuing chunk taking KV beyond
        # the reservations.
        _sglang_spec("spec_eos_ngram_chunked", 915,
                     _requests(rng(915), 30, 20.0, (128, 384), (100, 400)),
                     num_gpu_blocks=800, **ngram, **{**eos, "chunked_prefill_size": 64}),
    ]


SGLANG_SPEC_WORKLOADS = {w["name"]: w for w in sglang_spec_workloads()
                         + sglang_spec_eos_workloads()}


def _sglang_hicache(name: str, seed: int, requests: list[list[Any]], *, hicache_ratio: float,
                    transfer: str = "next_batch", **kwargs: Any) -> Workload:
    """An SGLang workload with `--enable-hierarchical-cache` (the radix cache on, a host pool of
    `hicache_ratio` times the device pool, SGLang's default write_through policy and
    page_first layout) and `hicache_transfer`, when the recorder lets a device <-> host copy
    read done (`sglang_hicache.py`: "next_batch", the GPU's case; "fence"; "immediate";
    "bandwidth", with `hicache_host_bandwidth_gb_s`)."""
    return _sglang(name, seed, requests, disable_radix_cache=False,
                   enable_hierarchical_cache=True, hicache_ratio=hicache_ratio,
                   hicache_transfer=transfer, **kwargs)


def sglang_hicache_workloads() -> list[Workload]:
    """HiCache workloads (`record_sglang.py` records them when named): device pools that the
    shared prefixes overflow, so prefixes are demoted to host and loaded back. Under
    tests/golden: the two `hicache_host_tight_chunked` ones (the others' copies, read done at
    an idle pass at once, have no duration servesim can give them: the `_bw` ones below)."""
    def rng(seed: int) -> np.random.Generator:
        return np.random.default_rng(seed)

    reload = _prefixed(rng(201), 40, 8.0, 8, (1024, 2048), (16, 256), (16, 64))
    return [
        # Eight system prompts of 1024-2048 tokens (about 12k in all) on a device pool of 4000,
        # a host pool of 4x (16k: the prefixes fit, with the suffixes and outputs it fills and
        # evicts too): prefixes are demoted to host when evicted (write_through backs each up
        # on insertion) and loaded back when their group returns; chunks of 2048.
        _sglang_hicache("hicache_prefix_reload", 201, reload,
                        hicache_ratio=4.0, num_gpu_blocks=4000, chunked_prefill_size=2048),
        # The same requests with the overlap loop: backups flushed one batch later (after the
        # next batch is launched), so copies read done a batch later too.
        _sglang_hicache("hicache_prefix_reload_overlap", 201, reload,
                        hicache_ratio=4.0, num_gpu_blocks=4000, chunked_prefill_size=2048,
                        disable_overlap_schedule=False),
        # Whole prompts (12 of 512-1536 tokens) repeated in bursts, a device pool of 3000 and a
        # host pool of 3x, chunks of 512: a repeat finds its prompt on device, on host (loaded
        # back, all but the last token), or gone.
        _sglang_hicache("hicache_repeat", 203,
                        _repeated(rng(203), 60, 12, (32, 96), (8, 64), (2, 6), (0.2, 1.0)),
                        hicache_ratio=3.0, num_gpu_blocks=3000, chunked_prefill_size=512),
        # A tight host pool (1.5x the device's 4000: write_through keeps a host copy of nearly
        # everything on device, so little room is left for host-only prefixes): host
        # evictions (LRU among host-only leaves) decide which demoted prefixes can be loaded
        # back; chunks of 512.
        _sglang_hicache("hicache_host_tight_chunked", 204,
                        _prefixed(rng(204), 60, 10.0, 8, (512, 1536), (16, 512), (16, 128)),
                        hicache_ratio=1.5, num_gpu_blocks=4000, chunked_prefill_size=512),
        # The same pressure with the overlap loop and chunks of 256 (a chunk's prefix is
        # inserted, and backed up, as the next chunk is scheduled).
        _sglang_hicache("hicache_host_tight_chunked_overlap", 205,
                        _prefixed(rng(205), 60, 10.0, 8, (512, 1536), (16, 512), (16, 128)),
                        hicache_ratio=1.5, num_gpu_blocks=4000, chunked_prefill_size=256,
                        disable_overlap_schedule=False),
    ]


def sglang_hicache_bandwidth_workloads() -> list[Workload]:
    """The HiCache workloads with copies timed at a host link's bandwidth ("bandwidth", as
    servesim times them), outputs sampled (temperature 1: each request's outputs its own,
    as in real serving, where greedy decoding of a repeated prompt would share them in the
    tree): at 25 GB/s (5.2 us a token: a 2048-token prefix loads in 11 ms, beside steps of
    4-45 ms), `_bw`; and `hicache_prefix_reload_slow` at 1 GB/s (131 us a token), where
    load-backs stretch the batches that carry them and backups lag many steps."""
    out = []
    for w in sglang_hicache_workloads():
        variants = [("_bw", 25.0)] + ([("_slow", 1.0)] if w["name"] == "hicache_prefix_reload"
                                      else [])
        for suffix, gb_s in variants:
            out.append({**w, "name": w["name"] + suffix,
                        "settings": {**w["settings"], "hicache_transfer": "bandwidth",
                                     "hicache_host_bandwidth_gb_s": gb_s,
                                     "temperature": 1.0}})
    return out


def sglang_hicache_write_back_workloads() -> list[Workload]:
    """HiCache with `--hicache-write-policy write_back` (a node is copied to the host only when
    evicted from the device, the scheduler waiting for the copy), copies timed at 25 GB/s
    ("bandwidth") and outputs sampled, as the `_bw` ones: the write_through workloads'
    requests and pools (a host 1.5x and 4x the device's), normal and overlap loops, where
    evictions wait for their copies (with the overlap loop, behind the batch in flight) and a
    full host frees its copies of prefixes loaded back first; and a host pool too small for
    some prefixes, which are dropped."""
    by_name = {w["name"]: w for w in sglang_hicache_workloads()}
    out = []
    for base in ("hicache_host_tight_chunked", "hicache_host_tight_chunked_overlap",
                 "hicache_prefix_reload", "hicache_prefix_reload_overlap"):
        w = by_name[base]
        out.append({**w, "name": base.replace("hicache_", "hicache_write_back_", 1),
                    "settings": {**w["settings"], "hicache_write_policy": "write_back",
                                 "hicache_transfer": "bandwidth",
                                 "hicache_host_bandwidth_gb_s": 25.0, "temperature": 1.0}})
    # The shared prefixes with a host pool of 0.4x (1,600 tokens): a prefix of more finds no
    # room even with the host emptied, and is dropped (`drop_subtree_no_host`).
    reload = out[2]
    out.append({**reload, "name": "hicache_write_back_host_small",
                "settings": {**reload["settings"], "hicache_ratio": 0.4}})
    return out


SGLANG_HICACHE_WORKLOADS = {w["name"]: w for w in (sglang_hicache_workloads()
                                                   + sglang_hicache_bandwidth_workloads()
                                                   + sglang_hicache_write_back_workloads())}


def _sglang_spec_hicache(name: str, seed: int, requests: list[list[Any]], *, spec: dict[str, Any],
                         hicache_ratio: float, gb_s: float = 25.0, **kwargs: Any) -> Workload:
    """A speculative-decoding workload with `--enable-hierarchical-cache` too (recorded by
    `record_sglang_spec.py`), its copies timed at `gb_s` ("bandwidth"); greedy outputs (the
    recorder sets the verify's logits)."""
    return _sglang_spec(name, seed, requests, disable_radix_cache=False,
                        enable_hierarchical_cache=True, hicache_ratio=hicache_ratio,
                        hicache_transfer="bandwidth", hicache_host_bandwidth_gb_s=gb_s,
                        **spec, **kwargs)


def sglang_spec_hicache_workloads() -> list[Workload]:
    """Speculative decoding with the hierarchical cache: shared prefixes that overflow the
    device pool, demoted to host and loaded back, with the draft's KV copied beside the
    target's (EAGLE: one more layer a token; NGRAM: none)."""
    def rng(seed: int) -> np.random.Generator:
        return np.random.default_rng(seed)

    eagle, ngram = _numbers("EAGLE", 3, 1, 4), _numbers("NGRAM", 1, 10, 12)
    reload = _prefixed(rng(801), 30, 8.0, 6, (512, 1024), (16, 128), (8, 48))
    overlap: dict[str, Any] = {"disable_overlap_schedule": False}
    return [
        # Six system prompts of 512-1024 tokens on a device pool of 2500, a host pool of 3x:
        # prefixes demoted to host and loaded back (EAGLE: 33 layers a token copied), at
        # 25 GB/s and at 1 GB/s (loads stretch their batches; an arrival while a backup runs
        # is taken at once); n-gram (no draft KV) with the overlap loop.
        _sglang_spec_hicache("spec_hicache_eagle_reload_bw", 801, reload, spec=eagle,
                             hicache_ratio=3.0, num_gpu_blocks=2500, chunked_prefill_size=1024,
                             max_running_requests=64),
        _sglang_spec_hicache("spec_hicache_eagle_reload_slow", 801, reload, spec=eagle,
                             hicache_ratio=3.0, num_gpu_blocks=2500, chunked_prefill_size=1024,
                             max_running_requests=64, gb_s=1.0),
        _sglang_spec_hicache("spec_hicache_ngram_reload_overlap_bw", 802,
                             _prefixed(rng(802), 30, 8.0, 6, (512, 1024), (16, 128), (8, 48)),
                             spec=ngram, hicache_ratio=3.0, num_gpu_blocks=2500,
                             chunked_prefill_size=1024, max_running_requests=64, **overlap),
        # Three short prefixes, many short requests in a tight pool: the decode step's
        # top-ups retract requests and evict (backed prefixes stay in host memory, which
        # evicts too), loads back beside prefills.
        _sglang_spec_hicache("spec_hicache_eagle_retract_bw", 803,
                             _prefixed(rng(803), 60, 400.0, 3, (96, 160), (4, 24), (4, 12)),
                             spec=eagle, hicache_ratio=2.0, num_gpu_blocks=350,
                             chunked_prefill_size=64, max_running_requests=64),
    ]


def sglang_spec_hicache_write_back_workloads() -> list[Workload]:
    """Three of those with `--hicache-write-policy write_back`: nothing backed up at
    insertion; each node the device pool evicts is copied to host first, the scheduler
    waiting for the copy (EAGLE's draft KV with it), then loaded back where a prompt
    shares it; the decode step's retractions evict so too."""
    picked = ("spec_hicache_eagle_reload_bw", "spec_hicache_ngram_reload_overlap_bw",
              "spec_hicache_eagle_retract_bw")
    return [{**w, "name": w["name"].replace("spec_hicache_", "spec_hicache_write_back_"),
             "settings": {**w["settings"], "hicache_write_policy": "write_back"}}
            for w in sglang_spec_hicache_workloads() if w["name"] in picked]


SGLANG_SPEC_HICACHE_WORKLOADS = {
    w["name"]: w
    for w in sglang_spec_hicache_workloads() + sglang_spec_hicache_write_back_workloads()}
