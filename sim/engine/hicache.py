"""The copies of SGLang's hierarchical cache (`sim.core.hicache`) in time, as SGLang 0.5.23's
cache controller runs them (`managers/cache_controller.py`, `mem_cache/l2_transfer.py`):

- Backups queued since the last flush go as one copy to the host at each scheduler pass
  (`flush_pending_backups`, at the end of a batch's results and at the start of a pass): on a
  stream of their own, after the forward work already queued (the fence on the forward
  stream: with the overlap loop, the batch in flight), one after another.
- With write_back a backup is made as a pass evicts, and the pass waits for it
  (`writing_check(write_back=True)` synchronises on its event): each on the same stream,
  after the forward work already launched (with the overlap loop, the batch in flight) and
  the copies before it; the batch the pass launches starts when the last ends at the
  earliest, and with the overlap loop the batch in flight's results are taken then too.
- Loads queued by a pass's admissions go as one copy to the GPU with the batch that needs
  them, layer by layer ahead of its forward: each attention layer waits for its own layer's
  copy, so the batch takes `max(forward, load + forward / layers)`.
- A copy's ack is taken at the scheduler's first pass after it ended (`check_hicache_events`):
  a write's when its copy ends, a load's when its batch has (its last layer is copied before
  the batch's last layer runs).

Each GPU copies its share of a block over its own host link (tensor-parallel ranks side by
side), at `host_bandwidth_gb_s`, or 80% of the GPU's PCIe rate (`host_link_bytes_s`; SGLang's
copy kernels' own rate was not measured here).

With speculative decoding a one-layer drafter's KV (EAGLE, EAGLE-3, NEXTN) is copied with the
target's, token for token, in the same copies (`speculative/base_spec_worker.py`
`_build_hicache_draft_plan`): EAGLE's and EAGLE-3's in a host pool of its own beside the
target's ("sidecar", `mem_cache/hybrid_cache/hybrid_pool_assembler.py`
`build_full_draft_pools`: as many tokens as the target's host pool, indexed as it is), an MTP
head's as one more layer of the target's host pool ("packed", `build_kv_only_group`,
`pool_host/mha.py`: `layer_num` counts it, so `--hicache-size` buys fewer tokens). A copy
moves every pool's bytes (`HybridCacheController._transfer_num_bytes`), so a block takes
(L + 1) / L of the target's time; a load still ends with its batch's last target layer (the
draft layer is copied in the first layer's stage, `l2_transfer.py` `submit_host_to_device`).
n-gram has no draft KV."""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING

from sim.config.errors import InputError
from sim.core.hicache import WRITE_THRESHOLDS, HierarchicalCache, HostCopy
from sim.engine.cpu_tier import host_rate_bytes_s

if TYPE_CHECKING:
    from sim.config.replica import ReplicaConfig
    from sim.core.state import ReplicaState
    from sim.engine.replica import Iteration


class HostCacheCopies:
    """The copy streams of one replica's hierarchical cache (module docstring)."""

    def __init__(self, kv: HierarchicalCache, s_per_block: float, num_layers: int) -> None:
        self.kv = kv
        self.s_per_block = s_per_block
        self.num_layers = num_layers
        self._writes: deque[tuple[float, HostCopy]] = deque()  # (end, copy), oldest first
        self._loads: deque[tuple[Iteration, HostCopy]] = deque()
        self._write_free_s = -math.inf
        self._load: HostCopy | None = None  # the load of the iteration being planned
        self._last: Iteration | None = None  # the last iteration launched (the fence)
        self.load_busy_s = 0.0
        self.store_busy_s = 0.0

    def pass_start(self, now_s: float) -> None:
        """A scheduler pass at `now_s`: flush the backups queued, take the acks due."""
        kv = self.kv
        copy = kv.take_writes()
        if copy is not None:
            fence_s = self._last.end_s if self._last is not None else -math.inf
            start_s = max(now_s, fence_s, self._write_free_s)
            copy_s = copy.num_blocks * self.s_per_block
            self._write_free_s = start_s + copy_s
            self.store_busy_s += copy_s
            self._writes.append((self._write_free_s, copy))
        writes, loads = self._writes, self._loads
        while writes and writes[0][0] <= now_s:
            kv.ack(writes.popleft()[1])
        while loads and loads[0][0].end_s <= now_s:
            kv.ack(loads.popleft()[1])

    def wait_writes(self, now_s: float) -> float:
        """write_back: the backups the pass that began at `now_s` made as it evicted, each
        copied while the scheduler waits for it (`writing_check(write_back=True)`): after the
        forward work launched (the fence) and the copies before it; when the pass can go on
        (`now_s` if none)."""
        writes = self.kv.take_sync_writes()
        if not writes:
            return now_s
        fence_s = self._last.end_s if self._last is not None else -math.inf
        for num_blocks in writes:
            start_s = max(now_s, fence_s, self._write_free_s)
            copy_s = num_blocks * self.s_per_block
            self.store_busy_s += copy_s
            now_s = self._write_free_s = start_s + copy_s
        return now_s

    def duration_s(self, forward_s: float) -> float:
        """The iteration being planned, of `forward_s` on the GPU, with the loads its pass
        queued (taken now) copied layer by layer ahead of its layers."""
        load = self._load = self.kv.take_load()
        if load is None:
            return forward_s
        load_s = load.num_blocks * self.s_per_block
        self.load_busy_s += load_s
        return max(forward_s, load_s + forward_s / self.num_layers)

    def launched(self, it: Iteration) -> None:
        """`it` was sent to the GPU (its start and end final)."""
        self._last = it
        if self._load is not None:
            self._loads.append((it, self._load))
            self._load = None

    @property
    def busy(self) -> bool:
        """Whether a copy's ack is still to be taken."""
        return bool(self._writes or self._loads)

    def next_done_s(self) -> float:
        """When the next ack can be taken."""
        write_s = self._writes[0][0] if self._writes else math.inf
        return min(write_s, self._loads[0][0].end_s) if self._loads else write_s

    def facts(self) -> dict[str, float]:
        """The tier after a run, as numbers (`sim.results.metrics.offload`)."""
        kv = self.kv
        counters = kv.counters
        return {"num_cpu_blocks": kv.num_host_blocks,
                "num_cpu_blocks_used": kv.num_host_used_blocks,
                **{name: getattr(counters, name) for name in counters.__slots__},
                "load_busy_s": self.load_busy_s, "store_busy_s": self.store_busy_s,
                "load_s_per_block": self.s_per_block, "num_blocks_awaiting_stores": 0}


def host_cache_blocks(cfg: ReplicaConfig, num_gpu_blocks: int) -> int:
    """The host pool of `cfg`'s hierarchical cache in the GPU's blocks: `size_gb` per rank
    over a token's KV on one GPU, or `ratio` times the GPU pool's tokens, plus a page
    (`HostKVCache.__init__`; SGLang's page is one token here)."""
    hicache = cfg.scheduler.hierarchical_cache  # type: ignore[attr-defined]
    if hicache.size_gb > 0:
        bytes_per_token = cfg.parallelism.kv_bytes_per_token_per_gpu(cfg.model_shape)
        draft_layers, packed = draft_kv_layers(cfg)
        if packed:  # (an MTP head's layer is one of the host pool's: its size buys fewer)
            bytes_per_token += draft_layers * cfg.parallelism.kv_bytes_per_layer_token_per_gpu(
                cfg.model_shape)
        num_tokens = int(hicache.size_gb * 1e9 // bytes_per_token)
    else:
        num_tokens = int(num_gpu_blocks * cfg.kv_cache.block_size * hicache.ratio)
    return (num_tokens + 1) // cfg.kv_cache.block_size


def draft_kv_layers(cfg: ReplicaConfig) -> tuple[int, bool]:
    """The drafter's KV layers the hierarchical cache copies beside the target's, and whether
    they are packed into the target's host pool (an MTP head) rather than a pool of their own
    (module docstring); (0, False) without a drafter's KV."""
    spec = getattr(cfg.scheduler, "speculative", None)
    if spec is None or not spec.bigram_keys:  # (n-gram: no draft KV; a draft model: refused)
        return 0, False
    return 1, spec.algorithm == "nextn"


def write_threshold(cfg: ReplicaConfig) -> int:
    """Hits before a node is backed up at insertion (write-through; 0: write_back)."""
    return WRITE_THRESHOLDS.get(cfg.scheduler.hierarchical_cache.write_policy, 0)  # type: ignore[attr-defined]


def attach_host_cache(cfg: ReplicaConfig, state: ReplicaState, pool: str, field: str,
                      source: str) -> HostCacheCopies | None:
    """The copies' timing of the replica's hierarchical cache; None without one. What is not
    modelled is refused, one line naming the field."""
    hicache = getattr(cfg.scheduler, "hierarchical_cache", None)
    if hicache is None:
        return None
    where = f"{field}.scheduler.hierarchical_cache"
    problem = None
    if not cfg.prefix_caching:
        problem = "is the radix cache's host tier: set prefix_caching: true"
    elif pool == "decode":
        problem = "on a decode pool is not modelled yet (servesim issue 47)"
    elif cfg.parallelism.pipeline > 1:
        problem = "on a pipeline is not modelled yet (servesim issue 47)"
    if problem is not None:
        raise InputError(source, where, hicache.model_dump(exclude_defaults=True),
                         f"SGLang's hierarchical cache {problem}")
    kv = state.kv
    assert isinstance(kv, HierarchicalCache)
    if kv.num_host_blocks < 1:
        raise InputError(source, f"{where}.size_gb", hicache.size_gb,
                         f"holds no KV block of {cfg.model_shape.name}")
    bytes_per_token = (cfg.parallelism.kv_bytes_per_token_per_gpu(cfg.model_shape)
                       + draft_kv_layers(cfg)[0]
                       * cfg.parallelism.kv_bytes_per_layer_token_per_gpu(cfg.model_shape))
    block_bytes_per_gpu = bytes_per_token * cfg.kv_cache.block_size
    return HostCacheCopies(kv, block_bytes_per_gpu / host_rate_bytes_s(
        cfg, hicache.host_bandwidth_gb_s), cfg.model_shape.num_layers)
