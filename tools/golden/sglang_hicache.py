"""SGLang 0.5.23's hierarchical cache (HiCache: host memory as a second KV tier) on a CPU, for
`tools/golden/record_sglang.py` (workloads with `settings.enable_hierarchical_cache`).

`--enable-hierarchical-cache` builds, in `UnifiedRadixCache.init_hicache`
(mem_cache/unified_radix_cache.py:455), a host KV pool (`MHATokenToKVPoolHost`,
mem_cache/pool_host/mha.py) and a `HybridCacheController`
(mem_cache/hybrid_cache/hybrid_cache_controller.py) over `HiCacheController`
(managers/cache_controller.py), whose copies run on an `L2TransferEngine`
(mem_cache/l2_transfer.py). SGLang's tree (the Rust TreeCore: matches, host hits, backups,
demotions, host evictions, locks), the host pool's slot accounting, the controller's queues
and acks, and the scheduler's admission of load-backs (schedule_policy.py `add_one_req`) all
run unchanged. What has no CPU code in the PyPI wheels, and is replaced here, is the data
movement and the device's stream/event synchronisation:

1. Pinning: `alloc_with_host_register` (pool_host/common.py:349) calls `_cuda_host_register`
   (common.py:143, `torch.cuda.cudart().cudaHostRegister`), which needs a CUDA driver. It is
   a no-op here: page-locking changes copy speed, not what is copied.
2. The copies: with `_is_cuda` false, pool_host/mha.py:59 never imports the `sgl_kernel.kvcacheio`
   transfer ops, and the wheel's op library (CUDA) is not loaded. Registered here as CPU ops
   (`torch.ops.sgl_kernel.*`, as `sglang_cpu_ops.py` does for others) and bound into mha.py:
   `transfer_kv_per_layer_pf_lf` (host page_first -> device, one layer: the load-back,
   mha.py:483 in `load_to_device_per_layer`), `transfer_kv_all_layer_lf_pf` (device -> host
   page_first, all layers: the backup, mha.py:647 in `backup_from_device_all_layer`; without
   it the first backup fails with a NameError), and the
   layer_first pair `transfer_kv_per_layer` / `transfer_kv_all_layer`. Each copies the
   token rows named by the index tensors (`check()` runs a round trip).
3. Completion: on a CPU, `get_device_module()` is `torch.cpu`, whose `Event.query()` is always
   True and whose streams do nothing, so every copy would read as done at the first check.
   On a GPU an ack is observed when `UnifiedRadixCache._count_ready_acks`
   (unified_radix_cache.py:3404) finds its `finish_event.query()` true, polled once per
   scheduling pass by `check_hicache_events` (unified_radix_cache.py:3651, from
   `Scheduler.get_next_batch_to_run` -> `_process_hicache_events`, scheduler.py:3878). Until
   then a written node stays locked (`_execute_and_commit_kv_backup` ->
   `inc_lock_ref`, released by `_finish_write_through_ack`) and pending in the tree, and a
   loaded one stays locked (`ongoing_load_back`, released by `loading_check`). So when a copy
   reads done changes which nodes are evictable, hence admissions. `TransferClock` decides
   it on the recorder's virtual clock, by the workload's `hicache_transfer`:

   Backups are queued (`_execute_kv_backup`, `write(..., flush=False)`) and submitted by
   `flush_pending_backups`: at the end of `process_batch_result` (scheduler.py:5106) and at
   the top of `check_hicache_events`; load-backs queued at admission are submitted by
   `ready_to_load_host_cache` once the batch is built (scheduler.py:4351).

   * "immediate": done when submitted (torch.cpu.Event as it is): a backup flushed after a
     batch's result is acked by the very next check, before the next batch is built.
   * "fence": done once the forward work launched before it was submitted has ended, a copy
     of no duration behind SGLang's fences: `start_writing` makes the D2H stream wait for the
     forward stream (cache_controller.py:893, `write_fence_stream`) and `start_loading` the
     H2D stream (cache_controller.py:1039, `load_fence_stream`), both set to the model
     runner's forward stream (scheduler.py:619-624). With the normal loop nothing is in
     flight when a copy is submitted, so this equals "immediate"; with the overlap loop a
     backup flushed with batch k's result (processed once batch k+1 is launched) is done at
     k+1's end, a load-back for batch k at k-1's end.
   * "next_batch" (the GPU's case, the default): done at the end of the first batch launched
     after it was submitted (behind the fence, and no longer than that batch: HiCache's
     premise, a load-back overlapped layer by layer with the batch that consumes it, whose
     attention waits for each layer's `LayerLoadingEvent`, cache_controller.py:65, and a
     write-through hidden behind the next forward); if the engine goes idle first (a pass
     that launches nothing, none in flight), at that pass (SGLang's idle loop spins, and the
     copy ends within it). So with the normal loop (the pass that builds batch m starts at
     the end of batch m-1) a backup flushed with batch k's result reads done at the check
     that builds batch k+2, a load-back submitted for batch k at the one that builds k+1;
     with the overlap loop (the pass that builds batch m starts at the end of m-2, and batch
     k's result is processed once k+1 is launched, so its backup is fenced behind k+1 and
     runs beside k+2) at the checks that build k+4 and k+2. On a GPU the check right after a
     submission cannot see it done (the copy, of megabytes for a real model, has barely
     started: the scheduler's Python between `flush_pending_backups` and the query takes
     microseconds), and a copy fenced behind the batch in flight starts only at its end:
     this is the earliest check at which a copy shorter than a step reads done, what a
     real engine sees when copies hide behind compute. Copies longer than a step (large
     prefixes on a slow link) would read done later still: "bandwidth" times them.

   * "bandwidth" (`hicache_host_bandwidth_gb_s`): copies timed as servesim times them
     (`sim/engine/hicache.py`), each of n tokens taking n * s, s = `BYTES_PER_TOKEN` /
     (bandwidth * 1e9), the KV of a token of servesim's default model on one GPU
     (Llama-3-8B: 2 x 8 KV heads x 128 x 32 layers x 2 bytes), and with a drafter's KV
     host pool beside the target's (speculative decoding: `draft_layers`) that many layers
     more (`TransferClock.set_draft_layers`). A flushed backup (the tokens
     of `start_writing`'s merged queue) starts at the latest of its flush, the end of the
     last batch launched so far (the fence on the forward stream) and the end of the backup
     before it (one D2H stream), and reads done n * s later. A load-back (the tokens of
     `start_loading`'s merged queue, submitted as a pass builds its batch) runs layer by
     layer ahead of that batch's forward, whose layers each wait for their own layer's copy,
     so the batch takes max(forward, n * s + forward / `NUM_LAYERS`) (`duration_s`; the
     recorder's step time), and the load reads done at that batch's end. An ack is taken by
     the first check at or after its copy's end; with the engine idle and copies pending,
     SGLang's loop keeps polling, and the recorder passes again when the next copy ends
     (`HiCacheLog.next_copy_s`), or at the next arrival if that comes first.

   `synchronize()` (SGLang's blocking waits: `writing_check(write_back=True)` for the
   write_back policy, retraction backups) on a copy not yet done: with "bandwidth", the
   scheduler waits for its end, the virtual clock moved there (`TransferClock.wait`, counted
   as the fixture's `blocking_waits`; a batch launched by that pass starts then at the
   earliest, the results it processes after are taken then); otherwise the copy is marked
   done at once and counted (`TransferClock.forced`), the virtual clock not waiting.

   The events replaced are those of `cache_controller.py` (`LayerLoadingEvent`, whose reuse
   `LayerDoneCounter.update_producer` asserts is done) and `l2_transfer.py` (each ack's
   start/finish pair; no timing, as torch.cpu.Event), through their module-level
   `device_module`; streams stay torch.cpu's no-ops. Nothing else of torch.cpu changes.

On a CPU each copy runs when submitted (the stream context is a no-op), so loaded KV is in
place before the batch that reads it: outputs are those of a run without HiCache.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

TRANSFER_MODES = ("immediate", "fence", "next_batch", "bandwidth")
# "bandwidth": a token's KV and the layers of servesim's default model (Llama-3-8B, one GPU:
# 2 x 8 KV heads x 128 x 32 layers x 2 bytes), as tools/golden/replay.py replays fixtures.
BYTES_PER_TOKEN = 131072
NUM_LAYERS = 32


class TransferClock:
    """When each HiCache copy reads done, on the recorder's virtual clock (see the module
    docstring). `source` (the recorder) has the time (`now_s`) and the end of the batches
    launched so far (`gpu_free_s`); the recorder reports each launch (`on_launch`) and each
    idle pass (`on_idle`). With "bandwidth", `HiCacheLog` names each copy as it is submitted
    (`copy`), and the recorder asks each batch's duration (`duration_s`)."""

    def __init__(self, mode: str, host_bandwidth_gb_s: float | None = None) -> None:
        assert mode in TRANSFER_MODES, mode
        assert (host_bandwidth_gb_s is not None) == (mode == "bandwidth"), host_bandwidth_gb_s
        self.mode = mode
        self.source: Any = None
        self.unassigned: list[_Event] = []  # next_batch: recorded, no batch launched since
        self.forced = 0  # synchronize() on a copy not yet done, marked done at once
        self.waits = 0  # synchronize() on a timed copy not yet done ("bandwidth"), waited for
        # bandwidth: seconds a token, the copy being submitted ("write" and its end, or
        # "load"), the end of the last backup, the tokens loaded for the batch being built
        self.host_bandwidth_gb_s = host_bandwidth_gb_s
        self.bytes_per_token = BYTES_PER_TOKEN
        self.s_per_token = 0.0
        self.set_draft_layers(0)
        self._copy: tuple[str, float | None] | None = None
        self._write_free_s = -math.inf
        self._load_tokens = 0

    def set_draft_layers(self, num_layers: int) -> None:
        """A drafter's KV layers copied with the target's (its host pools beside the
        target's): a token's bytes are those of `NUM_LAYERS` + `num_layers` layers of the
        default model's."""
        self.bytes_per_token = BYTES_PER_TOKEN * (NUM_LAYERS + num_layers) // NUM_LAYERS
        if self.host_bandwidth_gb_s is not None:
            self.s_per_token = self.bytes_per_token / (self.host_bandwidth_gb_s * 1e9)

    @property
    def now_s(self) -> float:
        return float(self.source.now_s) if self.source is not None else 0.0

    @contextlib.contextmanager
    def copy(self, kind: str, num_tokens: int) -> Iterator[None]:
        """`start_writing` ("write") or `start_loading` ("load") submits a copy of
        `num_tokens`: with "bandwidth", the events it records read done at its end."""
        if self.mode != "bandwidth" or num_tokens == 0:
            yield
            return
        assert self._copy is None, self._copy
        if kind == "write":
            fence_s = float(self.source.gpu_free_s)
            start_s = max(self.now_s, fence_s, self._write_free_s)
            self._write_free_s = start_s + num_tokens * self.s_per_token
            self._copy = (kind, self._write_free_s)
        else:
            assert kind == "load", kind
            self._load_tokens += num_tokens
            self._copy = (kind, None)
        try:
            yield
        finally:
            self._copy = None

    def duration_s(self, forward_s: float) -> float:
        """The batch being launched, of `forward_s`, with the loads its pass submitted copied
        layer by layer ahead of its layers (servesim's `HostCacheCopies.duration_s`)."""
        if self.mode != "bandwidth" or not self._load_tokens:
            return forward_s
        load_s = self._load_tokens * self.s_per_token
        self._load_tokens = 0
        return max(forward_s, load_s + forward_s / NUM_LAYERS)

    def on_record(self, event: _Event) -> None:
        if self.mode == "immediate":
            event.done_s = -1.0
        elif self.mode == "fence":
            event.done_s = float(self.source.gpu_free_s) if self.source is not None else 0.0
        elif self.mode == "bandwidth":
            assert self._copy is not None, "an event recorded outside a copy"
            kind, end_s = self._copy
            event.done_s = end_s
            if kind == "load":  # (done when the batch that carries it ends)
                self.unassigned.append(event)
        else:
            event.done_s = None
            self.unassigned.append(event)

    def on_launch(self, end_s: float) -> None:
        """A batch was launched; it ends at `end_s`."""
        for event in self.unassigned:
            event.done_s = end_s
        self.unassigned.clear()

    def on_idle(self) -> None:
        """A pass launched nothing and nothing is in flight: the copies end in the idle spin
        (with "bandwidth", each at its own end; a load goes only with a batch)."""
        if self.mode == "bandwidth":
            assert not self.unassigned and not self._load_tokens
            return
        for event in self.unassigned:
            event.done_s = self.now_s
        self.unassigned.clear()

    def wait(self, end_s: float) -> None:
        """With "bandwidth", a blocking wait for a copy that ends at `end_s` (write_back's
        `writing_check(write_back=True)`): the scheduler's host waits, its clock moves on."""
        assert self.source is not None and end_s > self.now_s, end_s
        self.waits += 1
        self.source.now_s = end_s

    def done(self, event: _Event) -> bool:
        return event.done_s is not None and event.done_s <= self.now_s


CLOCK: TransferClock | None = None


class _Event:
    """Stands for the device module's Event in the HiCache modules: done per `CLOCK`. An
    event never recorded is done (torch.cuda's is too)."""

    def __init__(self) -> None:  # no enable_timing: SGLang then disables its timing
        self.done_s: float | None = -1.0

    def record(self, stream: Any = None) -> None:
        assert CLOCK is not None
        CLOCK.on_record(self)

    def query(self) -> bool:
        assert CLOCK is not None
        return CLOCK.done(self)

    def synchronize(self) -> None:
        assert CLOCK is not None
        if not CLOCK.done(self) and CLOCK.mode == "bandwidth" and self.done_s is not None:
            CLOCK.wait(self.done_s)  # a timed write: the scheduler waits for its end
        elif not CLOCK.done(self):
            CLOCK.forced += 1
            if self in CLOCK.unassigned:
                CLOCK.unassigned.remove(self)
            self.done_s = CLOCK.now_s

    def wait(self, stream: Any = None) -> None:
        pass  # a stream wait: the copy has run already (CPU)


class _DeviceModule:
    """torch.cpu, with `_Event` as its Event."""

    Event = _Event

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)


# --- the copies --------------------------------------------------------------------------------

_BUFFERS: dict[int, torch.Tensor] = {}  # data_ptr -> tensor, for the all-layer ops' pointer tables
_LIB = torch.library.Library("sgl_kernel", "FRAGMENT")


def _by_ptr(ptr: Any) -> torch.Tensor:
    return _BUFFERS[int(ptr)]


def _per_layer(src_k: torch.Tensor, dst_k: torch.Tensor, src_v: torch.Tensor,
               dst_v: torch.Tensor, src_indices: torch.Tensor, dst_indices: torch.Tensor,
               item_size: int, block_quota: int, num_warps_per_block: int) -> None:
    """One layer, both sides [token, ...]: dst[dst_indices] = src[src_indices]."""
    dst_k[dst_indices.long()] = src_k[src_indices.long()].to(dst_k.dtype)
    dst_v[dst_indices.long()] = src_v[src_indices.long()].to(dst_v.dtype)


def _per_layer_pf_lf(src_k: torch.Tensor, dst_k: torch.Tensor, src_v: torch.Tensor,
                     dst_v: torch.Tensor, src_indices: torch.Tensor, dst_indices: torch.Tensor,
                     layer_id: int, item_size: int, src_layout_dim: int, block_quota: int,
                     num_warps_per_block: int) -> None:
    """Host page_first [token, layer, ...] -> device layer [token, ...], layer `layer_id`."""
    dst_k[dst_indices.long()] = src_k[src_indices.long(), layer_id]
    dst_v[dst_indices.long()] = src_v[src_indices.long(), layer_id]


def _all_layer(src_k_layers: torch.Tensor, dst_k_layers: torch.Tensor,
               src_v_layers: torch.Tensor, dst_v_layers: torch.Tensor,
               src_indices: torch.Tensor, dst_indices: torch.Tensor, item_size: int,
               num_layers: int, block_quota: int, num_warps_per_block: int) -> None:
    """Every layer, layer_first on both sides (pointer tables)."""
    for layer in range(num_layers):
        for src, dst in ((src_k_layers, dst_k_layers), (src_v_layers, dst_v_layers)):
            _by_ptr(dst[layer])[dst_indices.long()] = _by_ptr(src[layer])[src_indices.long()]


def _all_layer_lf_pf(src_k_layers: torch.Tensor, dst_k: torch.Tensor,
                     src_v_layers: torch.Tensor, dst_v: torch.Tensor,
                     src_indices: torch.Tensor, dst_indices: torch.Tensor, item_size: int,
                     dst_layout_dim: int, num_layers: int, block_quota: int,
                     num_warps_per_block: int) -> None:
    """Device layers (pointer table) -> host page_first [token, layer, ...], every layer."""
    for layer in range(num_layers):
        dst_k[dst_indices.long(), layer] = _by_ptr(src_k_layers[layer])[src_indices.long()]
        dst_v[dst_indices.long(), layer] = _by_ptr(src_v_layers[layer])[src_indices.long()]


_TAIL = "int block_quota, int num_warps_per_block) -> ()"
_OPS = {
    "transfer_kv_per_layer": (
        "transfer_kv_per_layer(Tensor src_k, Tensor(a!) dst_k, Tensor src_v, Tensor(b!) dst_v, "
        "Tensor src_indices, Tensor dst_indices, int item_size, " + _TAIL, _per_layer),
    "transfer_kv_per_layer_pf_lf": (
        "transfer_kv_per_layer_pf_lf(Tensor src_k, Tensor(a!) dst_k, Tensor src_v, "
        "Tensor(b!) dst_v, Tensor src_indices, Tensor dst_indices, int layer_id, int item_size, "
        "int src_layout_dim, " + _TAIL, _per_layer_pf_lf),
    "transfer_kv_all_layer": (
        "transfer_kv_all_layer(Tensor src_k_layers, Tensor dst_k_layers, Tensor src_v_layers, "
        "Tensor dst_v_layers, Tensor src_indices, Tensor dst_indices, int item_size, "
        "int num_layers, " + _TAIL, _all_layer),
    "transfer_kv_all_layer_lf_pf": (
        "transfer_kv_all_layer_lf_pf(Tensor src_k_layers, Tensor(a!) dst_k, "
        "Tensor src_v_layers, Tensor(b!) dst_v, Tensor src_indices, Tensor dst_indices, "
        "int item_size, int dst_layout_dim, int num_layers, " + _TAIL, _all_layer_lf_pf),
}


def _register_ops() -> None:
    for name, (schema, fn) in _OPS.items():
        if not hasattr(torch.ops.sgl_kernel, name):
            _LIB.define(schema)
            _LIB.impl(name, fn, "CPU")


_INSTALLED = False


def install(mode: str, host_bandwidth_gb_s: float | None = None) -> TransferClock:
    """Patch SGLang's HiCache for a CPU (before the scheduler is built); the clock the
    recorder drives."""
    global CLOCK, _INSTALLED
    CLOCK = TransferClock(mode, host_bandwidth_gb_s)
    if _INSTALLED:
        return CLOCK
    import sgl_kernel.kvcacheio as kvcacheio
    import sglang.srt.managers.cache_controller as cache_controller
    import sglang.srt.mem_cache.l2_transfer as l2_transfer
    import sglang.srt.mem_cache.pool_host.common as pool_host_common
    import sglang.srt.mem_cache.pool_host.mha as mha

    assert cache_controller.device_module is torch.cpu, cache_controller.device_module
    assert l2_transfer.device_module is torch.cpu, l2_transfer.device_module
    pool_host_common._cuda_host_register = lambda buffer, granularity=None: None
    _register_ops()
    for name in _OPS:
        assert not hasattr(mha, name), name  # (only CUDA/HIP/XPU import them)
        setattr(mha, name, getattr(kvcacheio, name))
    cache_controller.device_module = _DeviceModule()
    l2_transfer.device_module = _DeviceModule()
    _INSTALLED = True
    return CLOCK


def register_buffers(sched: Any) -> Any:
    """Name the device and host KV buffers the all-layer ops get as pointers; the host pool."""
    group = sched.tree_cache.cache_controller.mem_pool_host
    for entry in group.entry_map.values():  # (a drafter's sidecar pool too)
        pool = entry.host_pool
        for buf in (*pool.device_k_buffers, *pool.device_v_buffers, *pool.k_data_refs,
                    *pool.v_data_refs):
            _BUFFERS[buf.data_ptr()] = buf
    return group.anchor_entry.host_pool


def draft_layers(sched: Any) -> int:
    """The drafter's KV layers SGLang's host pools hold beside the target's, as the spec
    worker's plan (`_build_hicache_draft_plan`) set them up: a sidecar pool's layers (EAGLE,
    EAGLE-3, a draft model), or those packed into the target's host pool (an MTP head)."""
    group = sched.tree_cache.cache_controller.mem_pool_host
    anchor = group.anchor_entry
    packed = anchor.host_pool.layer_num - anchor.host_pool.target_layer_num
    sidecars = sum(entry.host_pool.layer_num for entry in group.entry_map.values()
                   if entry is not anchor)
    draft = getattr(sched, "draft_worker", None)
    mode = draft.hicache_draft_plan.mode.value if draft is not None else "none"
    assert (mode == "sidecar") == (sidecars > 0) and (mode == "packed") == (packed > 0), (
        mode, sidecars, packed)
    return packed + sidecars


def check() -> None:
    """The copies' round trip: device rows -> host (page_first and layer_first) -> other
    device rows, every layer, equal."""
    _register_ops()
    import sgl_kernel.kvcacheio as kv

    torch.manual_seed(0)
    layers, heads, dim, n_dev, n_host = 3, 2, 4, 50, 40
    dev_k = [torch.randn(n_dev, heads, dim) for _ in range(layers)]
    dev_v = [torch.randn(n_dev, heads, dim) for _ in range(layers)]
    src = torch.randperm(n_dev)[:17]
    host_idx = torch.randperm(n_host)[:17]
    dst = torch.randperm(n_dev)[:17]

    def ptrs(ts: list[torch.Tensor]) -> torch.Tensor:
        for t in ts:
            _BUFFERS[t.data_ptr()] = t
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)

    # page_first
    host_k = torch.zeros(n_host, layers, heads, dim)
    host_v = torch.zeros(n_host, layers, heads, dim)
    kv.transfer_kv_all_layer_lf_pf(ptrs(dev_k), host_k, ptrs(dev_v), host_v, src, host_idx,
                                   0, 0, layers)
    out_k = [torch.zeros(n_dev, heads, dim) for _ in range(layers)]
    out_v = [torch.zeros(n_dev, heads, dim) for _ in range(layers)]
    for layer in range(layers):
        kv.transfer_kv_per_layer_pf_lf(host_k, out_k[layer], host_v, out_v[layer], host_idx,
                                       dst, layer, 0, 0)
        assert torch.equal(out_k[layer][dst], dev_k[layer][src])
        assert torch.equal(out_v[layer][dst], dev_v[layer][src])
    # layer_first
    hk = [torch.zeros(n_host, heads, dim) for _ in range(layers)]
    hv = [torch.zeros(n_host, heads, dim) for _ in range(layers)]
    kv.transfer_kv_all_layer(ptrs(dev_k), ptrs(hk), ptrs(dev_v), ptrs(hv), src, host_idx, 0,
                             layers)
    for layer in range(layers):
        ok, ov = torch.zeros(n_dev, heads, dim), torch.zeros(n_dev, heads, dim)
        kv.transfer_kv_per_layer(hk[layer], ok, hv[layer], ov, host_idx, dst, 0)
        assert torch.equal(ok[dst], dev_k[layer][src])
        assert torch.equal(ov[dst], dev_v[layer][src])


class HiCacheLog:
    """What a HiCache run records beyond the steps. Per step, what happened while its batch
    was built (since the launch before it; as a step's preemptions), and after the last launch
    (`tail`):

        loaded: [[request id, host hit, tokens loaded], ...] per `init_load_back` of an
            admitted request with a host hit (`req.host_hit_length`; the tokens copied back
            from host are part of the request's prefix, not of its scheduled tokens; 0 when
            the load was declined, e.g. under `load_back_threshold`, 10 tokens, and the hit
            is computed again), in order;
        written: tokens given host slots and queued for the device -> host copy
            (`cache_controller.write`: write-through backups, or write-back at eviction);
        evicted: tokens evicted from the device pool (`_evict`'s `num_tokens_evicted`);
        dropped: of those, tokens of leaves with no host copy (gone for good; the others stay
            in the tree as host-only, loadable): not backed up when evicted (write_through_
            selective: not hit often enough yet), or write_back's backup found no host room;
        host_evicted: tokens evicted from the host pool (`evict_host`);
        host_used: host pool tokens in use once the batch is built;
        inflight: [writes, loads] copies queued or not yet acknowledged then.
    """

    def __init__(self, sched: Any, clock: TransferClock, source: Any) -> None:
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        self.clock = clock
        clock.source = source
        self.cache = cache = sched.tree_cache
        self.controller = controller = cache.cache_controller
        self.host_pool = register_buffers(sched)
        self.draft_layers = draft_layers(sched)
        clock.set_draft_layers(self.draft_layers)
        self.steps: list[dict[str, Any]] = []
        self._reset()
        full = ComponentType.FULL

        original_init_load_back = cache.init_load_back

        def init_load_back(params: Any) -> Any:
            out = original_init_load_back(params)
            if out is not None and (out[0] > 0 or params.host_hit_length > 0):
                self.loaded.append([int(params.req.rid), int(params.host_hit_length),
                                    int(out[0])])
            return out

        original_write = controller.write

        def write(device_indices: Any, *args: Any, **kwargs: Any) -> Any:
            out = original_write(device_indices, *args, **kwargs)
            if out is not None:
                self.written += len(device_indices)
            return out

        original_evict = cache._evict

        def _evict(*args: Any, **kwargs: Any) -> Any:
            out = original_evict(*args, **kwargs)
            self.evicted += int(out.num_tokens_evicted)
            return out

        original_evict_leaf = cache._evict_device_leaf

        def _evict_device_leaf(node_id: Any, tracker: dict[Any, int]) -> Any:
            backed_up = cache.is_backuped(node_id)
            before = tracker[full]
            out = original_evict_leaf(node_id, tracker)
            if not backed_up:
                self.dropped += tracker[full] - before
            return out

        original_drop = cache._drop_subtree_no_host

        def _drop_subtree_no_host(node_id: Any, tracker: dict[Any, int]) -> bool:
            # (write_back: a leaf whose deferred backup found no host room)
            before = tracker[full]
            out = original_drop(node_id, tracker)
            self.dropped += tracker[full] - before
            return out

        original_evict_host = cache.evict_host

        def evict_host(*args: Any, **kwargs: Any) -> int:
            out = original_evict_host(*args, **kwargs)
            self.host_evicted += int(out)
            return out

        original_start_writing = controller.start_writing

        def start_writing() -> None:
            num_tokens = sum(len(op.device_indices) for op in controller.write_queue)
            with clock.copy("write", num_tokens):
                original_start_writing()

        original_start_loading = controller.start_loading

        def start_loading() -> int:
            num_tokens = sum(len(op.device_indices) for op in controller.load_queue)
            with clock.copy("load", num_tokens):
                return original_start_loading()

        cache.init_load_back = init_load_back
        controller.write = write
        controller.start_writing = start_writing
        controller.start_loading = start_loading
        cache._evict = _evict
        cache._evict_device_leaf = _evict_device_leaf
        cache._drop_subtree_no_host = _drop_subtree_no_host
        cache.evict_host = evict_host

    def _reset(self) -> None:
        self.loaded: list[list[int]] = []
        self.written = self.evicted = self.dropped = self.host_evicted = 0

    def entry(self) -> dict[str, Any]:
        c = self.controller
        return {"loaded": self.loaded, "written": self.written, "evicted": self.evicted,
                "dropped": self.dropped, "host_evicted": self.host_evicted,
                "host_used": int(self.host_pool.size - self.host_pool.available_size()),
                "inflight": [len(c.write_queue) + len(c.ack_write_queue),
                             len(c.load_queue) + len(c.ack_load_queue)]}

    def on_launch(self, end_s: float) -> None:
        self.steps.append(self.entry())
        self._reset()
        self.clock.on_launch(end_s)

    def on_idle(self) -> None:
        self.clock.on_idle()

    def next_copy_s(self) -> float | None:
        """With "bandwidth": when the next ack can be taken (a backup still queued: now, the
        next pass flushes it); None with none pending."""
        c = self.controller
        if self.clock.mode != "bandwidth":
            return None
        if c.write_queue:
            return self.clock.now_s
        ends = [queue[0].finish_event.done_s for queue in (c.ack_write_queue, c.ack_load_queue)
                if queue]
        assert None not in ends, ends
        return min(ends) if ends else None

    def body(self) -> dict[str, Any]:
        clock = self.clock
        return {"host_pool_tokens": int(self.host_pool.size),
                "transfer": clock.mode, "forced_waits": clock.forced,
                **({"blocking_waits": clock.waits} if clock.waits else {}),
                **({"host_bandwidth_gb_s": clock.host_bandwidth_gb_s,
                    "bytes_per_token": clock.bytes_per_token, "num_layers": NUM_LAYERS}
                   if clock.mode == "bandwidth" else {}),
                **({"draft_layers": self.draft_layers} if self.draft_layers else {}),
                "steps": self.steps, "tail": self.entry()}
