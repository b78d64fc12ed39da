"""A cluster in SimPy: replicas behind a router, colocated or split into prefill and decode
pools joined by KV-transfer links.

Links: each prefill replica sends KV through its own NIC, a `simpy.Resource` of capacity one, so
its transfers queue FIFO at full bandwidth while different replicas' transfers run in parallel.
FIFO rather than fair sharing because an RDMA NIC works through its send queue in order; for
equal transfers both give the same throughput and FIFO gives earlier first completions.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import numpy as np
import simpy

from sim.config import ReplicaConfig, Scenario
from sim.engine import Environment, Progress, Replica, simulate
from sim.errors import InputError
from sim.gpus import GPUS
from sim.kv_cache import KVCacheManager
from sim.latency import LATENCY_MODELS
from sim.models import MODELS, ModelShape
from sim.prefix_cache import Eviction, PrefixCachingKVManager
from sim.request import Request, Status
from sim.routers import ROUTERS
from sim.schedulers import SCHEDULERS, Scheduler
from sim.state import ReplicaState


class Cluster:
    """Builds the replicas a scenario describes and routes requests to them."""

    def __init__(self, scenario: Scenario, *, fast_forward: bool = True) -> None:
        self.env = env = Environment()
        self.source = scenario.source  # the scenario's file, named by errors found while building
        cfg = scenario.cluster
        self.horizon_s = scenario.horizon_s
        self.fast_forward = fast_forward
        seeds = np.random.SeedSequence(scenario.seed).spawn(2)
        self.router = ROUTERS.get(cfg.router.name)(cfg.router, np.random.default_rng(seeds[0]))
        self.replicas: list[Replica] = []
        if cfg.prefill is None or cfg.decode is None:
            self.front = [self._replica(scenario.replica, "colocated")
                          for _ in range(cfg.replicas)]
            self.decode: list[Replica] = []
            return
        self.front = [self._replica(cfg.prefill.replica, "prefill")
                      for _ in range(cfg.prefill.replicas)]
        self.decode = [self._replica(cfg.decode.replica, "decode")
                       for _ in range(cfg.decode.replicas)]
        self.decode_router = ROUTERS.get(cfg.decode_router.name)(
            cfg.decode_router, np.random.default_rng(seeds[1]))
        self.links = {r.replica_id: simpy.Resource(env, capacity=1) for r in self.front}
        self.link = cfg.link
        self.overlap = cfg.overlap_transfer
        self.model = MODELS.get(cfg.prefill.replica.model)

    def _replica(self, cfg: ReplicaConfig, pool: str) -> Replica:
        model = MODELS.get(cfg.model)
        scheduler = make_scheduler(cfg)
        latency = LATENCY_MODELS.get(cfg.latency.kind)(cfg.latency, model, GPUS.get(cfg.gpu))
        field = "replica" if pool == "colocated" else f"cluster.{pool}.replica"
        state = ReplicaState(kv_cache_for(cfg, model, field, self.source,
                                          eviction=type(scheduler).prefix_cache_eviction),
                             prefill_only=pool == "prefill")
        replica = Replica(self.env, len(self.replicas), scheduler, latency, state,
                          horizon_s=self.horizon_s, fast_forward=self.fast_forward, pool=pool,
                          on_handoff=self._handoff if pool == "prefill" else None,
                          where=(self.source, f"{field}.latency",
                                 str(getattr(cfg.latency, "path", "")) or cfg.latency.kind))
        self.replicas.append(replica)
        return replica

    def run(self, requests: list[Request], on_progress: Progress | None = None) -> None:
        """Simulate the arrivals to completion (or the horizon); check every replica after."""
        simulate(self.env, requests, self.route, self.horizon_s, on_progress)
        for replica in self.replicas:
            if self.horizon_s is not None:
                replica.stop(self.horizon_s)
            replica.state.check()

    def route(self, req: Request) -> None:
        """A request arrives: reject it if no decode replica could ever hold it, else route."""
        if self.decode:
            dec = self.decode[0]
            reason = dec.scheduler.reject_reason(req, dec.state.kv,
                                                 dec.state.num_kv_tokens_needed(req))
            if reason is not None:
                kind, _, detail = reason.partition(": ")
                req.status, req.reason = Status.REJECTED, f"{kind}: decode pool {detail}"
                return
        asked = req if self.router.needs_prefix_hits else None
        index = self.router.choose(req, [r.load(asked) for r in self.front])
        self.front[index].submit(req)

    def _handoff(self, req: Request) -> None:
        self.env.process(self._transfer(req))

    def _transfer(self, req: Request) -> Generator[simpy.Event, Any, None]:
        """Wait for blocks on a decode replica (KV stays on the prefill side meanwhile), then
        move the prompt's KV over the prefill replica's link."""
        source = self.replicas[req.prefill_replica_id]
        target = self.decode[self.decode_router.choose(req, [r.load() for r in self.decode])]
        yield target.reserve(req)
        req.transfer_start_s = self.env.now
        with self.links[source.replica_id].request() as slot:
            yield slot
            yield self.env.timeout(self.transfer_time_s(req))
        source.release(req)
        req.transfer_end_s = self.env.now
        target.join(req)

    def transfer_time_s(self, req: Request) -> float:
        """Link latency plus the prompt's KV bytes over the bandwidth; with overlap, only the
        part not already streamed while the prefill ran."""
        num_bytes = req.num_prompt_tokens * self.model.kv_bytes_per_token
        wire_s = num_bytes / (self.link.bandwidth_gb_s * 1e9)
        if self.overlap and req.first_scheduled_s is not None and req.prefill_end_s is not None:
            wire_s = max(0.0, wire_s - (req.prefill_end_s - req.first_scheduled_s))
        return self.link.latency_s + wire_s


def make_scheduler(cfg: ReplicaConfig) -> Scheduler:
    """The replica's scheduler, knowing the context window in force."""
    return SCHEDULERS.get(cfg.scheduler.name)(cfg.scheduler, max_model_len=cfg.context_len)


def kv_cache_for(cfg: ReplicaConfig, model: ModelShape, field: str = "replica",
                 source: str = "<scenario>", eviction: Eviction = "lru_block"
                 ) -> KVCacheManager:
    """The replica's KV cache: the blocks given, or what GPU memory holds after the weights;
    with prefix caching, evicting unused prefixes by `eviction`."""
    kv = cfg.kv_cache
    if kv.num_blocks is not None:
        return _manager(cfg, kv.num_blocks, eviction)
    gpu = GPUS.get(cfg.gpu)
    free_bytes = (gpu.memory_bytes * kv.gpu_memory_utilization - model.weight_bytes
                  - kv.activation_reserve_gb * 1e9)
    num_blocks = int(free_bytes // (kv.block_size * model.kv_bytes_per_token))
    if num_blocks <= 0:
        raise InputError(source, f"{field}.kv_cache", f"{cfg.model} on {cfg.gpu}",
                         f"no room for KV: weights take {model.weight_bytes / 1e9:.1f} GB of "
                         f"{gpu.memory_bytes * kv.gpu_memory_utilization / 1e9:.1f} GB usable")
    return _manager(cfg, num_blocks, eviction)


def _manager(cfg: ReplicaConfig, num_blocks: int, eviction: Eviction) -> KVCacheManager:
    if cfg.prefix_caching:
        return PrefixCachingKVManager(num_blocks, cfg.kv_cache.block_size, eviction)
    return KVCacheManager(num_blocks, cfg.kv_cache.block_size)
