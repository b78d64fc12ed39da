"""A replica's CPU tier for the KV cache (`replica.kv_offload`): which of vLLM's offloading
connectors it follows (0.15.1's, `sim.core.offload` timed by `sim.engine.offload`; 0.33.0's,
`sim.core.offload_jobs` timed by `sim.engine.offload_jobs`), its size, and its facts after a
run. A colocated replica, or either pool of a disaggregated cluster (the decode pool's stores
the prompt blocks each transfer brings: `sim.core.offload`), or each data-parallel rank, a
tier of the whole size (`sim.engine.data_parallel`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sim.config.errors import InputError
from sim.core.block_cache import BlockPrefixCache
from sim.core.offload import CpuTier, OffloadState
from sim.core.offload_arc import ArcTier
from sim.core.offload_jobs import JobOffloadState
from sim.core.offload_lru import OfferCounts, RankedTier
from sim.engine.offload import HostCopies
from sim.engine.offload_jobs import JobCopies
from sim.hardware.gpus import host_link_bytes_s

if TYPE_CHECKING:
    from sim.config.replica import ReplicaConfig
    from sim.core.state import ReplicaState

# A memory page of the host (`mmap.PAGESIZE` on x86-64 Linux): vLLM 0.33.0 rounds a tier
# block's bytes up to it.
HOST_PAGE_BYTES = 4096


def host_rate_bytes_s(cfg: ReplicaConfig, host_bandwidth_gb_s: float | None) -> float:
    """Bytes/s one GPU of `cfg` copies KV to or from host memory: the rate given (GB/s), or
    its PCIe link's default (`host_link_bytes_s`). Shared by vLLM's CPU tier and SGLang's
    hierarchical cache (`sim.engine.hicache`)."""
    return (host_bandwidth_gb_s * 1e9 if host_bandwidth_gb_s is not None
            else host_link_bytes_s(cfg.measured_gpu))


def attach_cpu_tier(cfg: ReplicaConfig, state: ReplicaState, pool: str, field: str,
                    source: str) -> HostCopies | JobCopies | None:
    """The replica's CPU tier (`replica.kv_offload`), on `state`, and its copies' timing; None
    without one. Its blocks: `size_gib` over a block's KV on every GPU of the replica
    (vLLM's `CPUOffloadingSpec`: page size times layers times world size); a copy of a block
    moves each GPU's share over that GPU's own host link, side by side."""
    offload = cfg.kv_offload
    if offload is None:
        return None
    where = f"{field}.kv_offload"
    value: object = offload.size_gib  # (the value the refusal names)
    problem = None
    if cfg.scheduler.name != "vllm_v1":
        problem = f"the CPU tier is vLLM's offloading connector: scheduler {cfg.scheduler.name!r}"
    elif not cfg.prefix_caching:
        problem = "the CPU tier keys blocks by their prefix: set prefix_caching: true"
    elif pool == "decode" and (spec := getattr(cfg.scheduler, "speculative", None)):
        where, value = f"{field}.scheduler.speculative.method", spec.method
        problem = "with speculative decoding on a decode pool"
    elif getattr(cfg.scheduler, "decode_reserve_tokens", 0) != 0:
        problem = ("queued requests hold the blocks they load; with blocks kept for running "
                   "requests' future tokens (decode_reserve_tokens, which vLLM does not have) "
                   "they could wait for each other for ever: leave decode_reserve_tokens at 0")
    elif (version := getattr(cfg.scheduler, "engine_version", None)) not in ("0.15.1",
                                                                              "0.33.0"):
        problem = (f"the CPU tier follows vLLM 0.15.1's and 0.33.0's offloading connectors, "
                   f"not {version}'s")
    elif offload.eviction_policy == "arc" and version == "0.15.1":
        where, value = f"{where}.eviction_policy", offload.eviction_policy
        problem = ("vLLM 0.15.1's ARC manager raises KeyError at the first store it makes "
                   "(`ARCOffloadingManager.touch` pops a block still being stored, then moves "
                   "it): use lru, or engine_version 0.33.0, whose ARC works")
    elif offload.store_threshold >= 2 and version == "0.15.1":
        where, value = f"{where}.store_threshold", offload.store_threshold
        problem = ("vLLM 0.15.1's offloading connector stores every block it is offered "
                   "(store_threshold came with the rewritten connector): leave it at 0, or "
                   "give engine_version 0.33.0")
    if problem is not None:
        if problem.startswith(("with", "on")):
            problem = f"a CPU tier {problem} is not modelled yet (servesim issue 47)"
        raise InputError(source, where, value, problem)
    model, par = cfg.model_shape, cfg.parallelism
    block_size = cfg.kv_cache.block_size
    block_bytes_per_gpu = par.kv_bytes_per_token_per_gpu(model) * block_size
    # (One rank's GPUs: vLLM's `world_size` counts tensor and pipeline ranks, not data-parallel
    # ones, so every data-parallel rank's engine core holds a tier of the whole size.)
    tier_block_bytes = block_bytes_per_gpu * par.num_gpus_per_rank
    if version == "0.33.0":  # (`CPUOffloadingSpec`: a block's bytes up to a memory page)
        tier_block_bytes = -(-tier_block_bytes // HOST_PAGE_BYTES) * HOST_PAGE_BYTES
    num_blocks = int(offload.size_gib * 2**30 // tier_block_bytes)
    if num_blocks < 1:
        raise InputError(source, f"{where}.size_gib", offload.size_gib,
                         f"holds no KV block of {model.name} "
                         f"({block_bytes_per_gpu * par.num_gpus_per_rank / 2**20:.1f} MiB "
                         "each)")
    seconds_per_block = block_bytes_per_gpu / host_rate_bytes_s(cfg, offload.host_bandwidth_gb_s)
    if version == "0.33.0":
        assert isinstance(state.kv, BlockPrefixCache)
        spec = getattr(cfg.scheduler, "speculative", None)
        offers = (OfferCounts(offload.store_threshold) if offload.store_threshold >= 2
                  else None)
        tier = (ArcTier(num_blocks, offers) if offload.eviction_policy == "arc"
                else RankedTier(num_blocks, offers))
        state.offload = JobOffloadState(
            tier, state.kv,
            defers_frees=bool(getattr(cfg.scheduler, "async_scheduling", False)),
            num_spec_step_tokens=(0 if spec is None else
                                  1 + spec.num_speculative_tokens + spec.num_lookahead_tokens),
            drops_last_hit_block=spec is not None and spec.method not in ("ngram",
                                                                          "draft_model"))
        return JobCopies(seconds_per_block, seconds_per_block)
    state.offload = OffloadState(CpuTier(num_blocks))
    return HostCopies(seconds_per_block, seconds_per_block)


def offload_facts(state: ReplicaState, copies: HostCopies | JobCopies) -> dict[str, float]:
    """A replica's CPU tier after a run: its size, counters and copy times, as numbers (the
    results add them up over replicas: `sim.results.metrics.offload`)."""
    assert state.offload is not None
    tier, kv = state.offload.tier, state.kv
    assert isinstance(kv, BlockPrefixCache)
    return {"num_cpu_blocks": tier.num_blocks, "num_cpu_blocks_used": tier.num_used_blocks,
            **{name: getattr(tier.counters, name) for name in tier.counters.__slots__},
            "load_busy_s": copies.load_busy_s, "store_busy_s": copies.store_busy_s,
            "load_s_per_block": copies.load_s_per_block,
            # Finished requests' GPU blocks held until their stores are reported done: vLLM's
            # engine idles with them held until its next step (a new request).
            # (Blocks, not references: finished requests share their prefix's blocks.)
            "num_blocks_awaiting_stores": len({id(block) for rid in state.offload.delayed
                                               for block in kv.blocks_of(rid)})}
