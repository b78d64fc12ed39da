"""The KV cache's CPU tier over a run (`summary.kv_offload`): per-tier hit rates, what was
copied each way and how long the copies kept the host link busy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from sim.results.columns import Table, column


def offload_stats(requests: Table, facts: Sequence[dict[str, float]]) -> dict[str, Any]:
    """Summed over the replicas with a CPU tier. Hit rates are shares of the prompt tokens of
    the requests admitted, at their first admission: `gpu` found in the GPU's prefix cache,
    `cpu` loaded from the tier (a request's `num_cached_tokens` counts both, as vLLM's does).
    `num_loaded_tokens` counts every load, reloads after a preemption too."""
    total = {key: sum(f[key] for f in facts) for key in facts[0]}
    admitted = ~np.isnan(column(requests, "first_scheduled_s"))
    num_prompt = int(column(requests, "num_prompt_tokens")[admitted].sum())
    num_cached = int(column(requests, "num_cached_tokens")[admitted].sum())
    num_first_cpu = int(total["num_first_hit_tokens"])

    def share(n: int) -> float | None:
        return n / num_prompt if num_prompt else None

    return {"hit_rate_tokens": {"gpu": share(num_cached - num_first_cpu),
                                "cpu": share(num_first_cpu)},
            **tier_stats(facts)}


def pool_offload_stats(facts: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Each pool's tiers (`tier_stats`), where a disaggregated cluster's decode pool has one:
    its tier loads only for requests preempted there (their first admission is the prefill
    pool's), so it has no hit rate of its own; what it stores and how long the copies kept
    its host links busy are its own."""
    return {pool: tier_stats(pool_facts) for pool, pool_facts in facts.items()}


def tier_stats(facts: Sequence[dict[str, float]]) -> dict[str, Any]:
    """What the tiers of `facts` did, summed: lookups, loads, stores, evictions, the copies'
    busy time."""
    total = {key: sum(f[key] for f in facts) for key in facts[0]}
    num_cpu = int(total["num_hit_tokens"])
    num_loads = int(total["num_hit_requests"])
    return {
        "num_cpu_blocks": [int(f["num_cpu_blocks"]) for f in facts],
        "num_cpu_blocks_used_at_end": [int(f["num_cpu_blocks_used"]) for f in facts],
        "num_lookups": int(total["num_lookups"]),
        "num_loads": num_loads,
        "num_loaded_tokens": num_cpu,
        "num_loaded_blocks": int(total["num_loaded_blocks"]),
        "num_stored_blocks": int(total["num_stored_blocks"]),
        "num_evicted_blocks": int(total["num_evicted_blocks"]),
        "num_refused_stores": int(total["num_refused_stores"]),
        "num_skipped_stores": int(total.get("num_skipped_stores", 0)),
        "num_delayed_lookups": int(total["num_delayed_lookups"]),
        "load_busy_s": total["load_busy_s"],
        "store_busy_s": total["store_busy_s"],
        "mean_load_s": (total["load_busy_s"] / num_loads) if num_loads else None,
        "load_s_per_block": facts[0]["load_s_per_block"],
    }
