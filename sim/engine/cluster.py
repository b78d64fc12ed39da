"""A cluster in SimPy: replicas behind a router, colocated or split into prefill and decode
pools joined by KV-transfer links (`sim.engine.disaggregation`)."""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Generator, Iterator, Sequence
from typing import Any, cast, overload

import numpy as np

from sim.config.errors import InputError
from sim.config.replica import ReplicaConfig
from sim.config.scenario import Scenario
from sim.core.block_cache import BlockPrefixCache
from sim.core.hicache import HierarchicalCache
from sim.core.kv_cache import KVCacheManager
from sim.core.radix_cache import Eviction, PrefixCachingKVManager
from sim.core.request import Request, Status
from sim.core.speculative import Acceptance
from sim.core.state import ReplicaState
from sim.engine.clients import Dispatcher
from sim.engine.clock import ANSWERED, NORMAL, At, Environment, Progress, simulate
from sim.engine.cpu_tier import attach_cpu_tier
from sim.engine.disaggregation import Disaggregation
from sim.engine.hicache import attach_host_cache, host_cache_blocks, write_threshold
from sim.engine.pipeline import PipelinedReplica
from sim.engine.replica import Replica
from sim.hardware.models import ModelShape
from sim.latency import LATENCY_MODELS
from sim.latency.base import (
    DraftingLatency,
    EagleDraftingLatency,
    LatencyModel,
    ScaledLatency,
    drafter_prompt_ratio,
    drafter_time_ratio,
)
from sim.latency.noise import IterationNoise
from sim.routers import ROUTERS
from sim.routers.base import LazyLoads, ReplicaLoad
from sim.schedulers import SCHEDULERS, Scheduler, SchedulerConfig
from sim.schedulers.sglang_config import SGLangConfig
from sim.schedulers.sglang_memory import (
    MemoryInputs,
    Role,
    default_mem_fraction_static,
    kv_pool_tokens,
    pre_load_bytes,
)
from sim.workloads.base import Sessions

# A request in one of these states can no longer time out.
DONE = (Status.FINISHED, Status.REJECTED, Status.FAILED)


def _field(pool: str) -> str:
    """Where a pool's replica is read from in a scenario."""
    return "replica" if pool == "colocated" else f"cluster.{pool}.replica"


class Cluster:
    """Builds the replicas a scenario describes and routes requests to them."""

    def __init__(self, scenario: Scenario, *, fast_forward: bool = True) -> None:
        self.env = env = Environment()
        self.source = scenario.source  # the scenario's file, named by errors found while building
        cfg = scenario.cluster
        self.horizon_s = scenario.horizon_s
        self.fast_forward = fast_forward
        # The client's timeout (`workload.timeout_s`): the requests that may time out, in
        # arrival order, which is deadline order (one timeout for all).
        self.timeout_s: float | None = scenario.workload.timeout_s
        self._deadlines: deque[Request] = deque()
        self._timeouts_idle: Any = None  # the timeouts' process, waiting for work
        # Closed-loop clients (`scenario.clients`) or sessions (`run`'s): sending then depends
        # on finishes (`sim.engine.clients`).
        self.clients_config = scenario.clients
        self.reacting = scenario.clients is not None
        self.dispatcher: Dispatcher | None = None
        self._answers: dict[float, list[Request]] = {}  # finishes by instant, not yet told
        self.frontend_s: list[float] = []  # each replica's API front end (a client's wait)
        self.seed = scenario.seed
        seeds = np.random.SeedSequence(scenario.seed).spawn(3)  # routers, clients
        self.router = ROUTERS.get(cfg.router.name)(cfg.router, np.random.default_rng(seeds[0]))
        self._client_seed = seeds[2]
        self.replicas: list[Replica] = []
        if cfg.prefill is None or cfg.decode is None:
            self.front = [self._unit(scenario.replica, "colocated")
                          for _ in range(cfg.replicas)]
            self.decode: list[Replica] = []
            self.disaggregation: Disaggregation | None = None
            if self.timeout_s is None and (len(self.front) == 1
                                           or not self.router.reads_loads):
                # No router or timeout reads a replica between its arrivals: an async one
                # may run its stretches unobserved (`sim.engine.fastpath.pipeline`).
                for replica in self.front:
                    replica.unobserved = True
            elif self.timeout_s is None and not self.router.needs_prefix_hits:
                for replica in self.front:
                    replica.read_by_loads = True
            return
        # Each pool's replicas (or replicas of data-parallel ranks: the routers pick one, its
        # balancer a rank; KV moves between ranks).
        self.front = [self._unit(cfg.prefill.replica, "prefill")
                      for _ in range(cfg.prefill.replicas)]
        self.decode = [self._unit(cfg.decode.replica, "decode")
                       for _ in range(cfg.decode.replicas)]
        decode_router = ROUTERS.get(cfg.decode_router.name)(
            cfg.decode_router, np.random.default_rng(seeds[1]))
        if self.timeout_s is None and not decode_router.needs_prefix_hits:
            # Read between its hand-offs only by the decode router, weighing loads: an async
            # decode replica may run its stretches, cut by transfers for it
            # (`sim.engine.fastpath.pipeline`). (A replica of ranks is stepped by its group.)
            for unit in self.decode:
                if isinstance(unit, Replica):
                    unit.read_by_loads = True
        self.disaggregation = Disaggregation(
            env, [rank for unit in self.front for rank in unit.ranks], self.decode,
            decode_router, cfg.link, cfg.overlap_transfer, cfg.prefill.replica.model_shape,
            lambda replicas: Loads(replicas, None), self._next_arrival, str(self.source))

    def _unit(self, cfg: ReplicaConfig, pool: str) -> Any:
        """One replica of `pool` as the routers see it: a replica, or one of data-parallel
        ranks in lockstep (`sim.engine.data_parallel`)."""
        if cfg.parallelism.data == 1:
            return self._replica(cfg, pool)
        from sim.engine.data_parallel import build_group

        # (A group's balancer draws from the scenario's seed and the group's first rank.)
        seed = np.random.SeedSequence((self.seed, len(self.replicas)))
        return build_group(self.env, cfg, str(self.source),
                           lambda: self._replica(cfg, pool, rank=True), _field(pool), seed)

    def _replica(self, cfg: ReplicaConfig, pool: str, rank: bool = False) -> Replica:
        model = cfg.model_shape
        field = _field(pool)
        scheduler = make_scheduler(cfg, role_of(field), rank)
        latency = make_latency(cfg, model, self.source, field)
        if getattr(cfg.scheduler, "enable_priority_scheduling", False) and \
                cfg.parallelism.pipeline > 1:
            raise InputError(self.source, f"{field}.scheduler.enable_priority_scheduling", True,
                             "SGLang's priority scheduling on pipeline stages is not modelled "
                             "yet (servesim issue 47)")
        state = ReplicaState(kv_cache_for(cfg, model, field, self.source, scheduler),
                             prefill_only=pool == "prefill", decode_only=pool == "decode",
                             waiting=scheduler.waiting_queue(pool))
        if pool == "prefill":
            state.first_token_dropped = scheduler.prefill_first_token == "dropped"
            state.first_token_held = scheduler.prefill_first_token == "held"
        spec = getattr(cfg.scheduler, "speculative", None)
        if spec is not None:
            if cfg.parallelism.pipeline > 1:
                raise InputError(self.source, f"{field}.scheduler.speculative.method",
                                 spec.method, "speculative decoding on a pipeline is not "
                                 "modelled yet (servesim issue 47)")
            if isinstance(state.kv, PrefixCachingKVManager):  # EAGLE keys by token pairs
                state.kv.bigram_keys = getattr(spec, "bigram_keys", False)
            state.drafting = True
            if pool != "prefill":  # (a prefill replica samples a request's first token only)
                state.acceptance = Acceptance(spec.draws(), self.seed,
                                              getattr(spec, "match_rate", 1.0))
            if isinstance(state.kv, BlockPrefixCache):
                state.kv.cache_at_free = getattr(scheduler, "kv_cached_when_freed", True)
        kind: type[Replica] = Replica
        if rank:
            from sim.engine.data_parallel import Rank
        elif self.fast_forward:
            from sim.engine.fastpath.replica import FastReplica  # not needed to step

            kind = FastReplica
        extra: dict[str, Any] = {}
        num_in_flight = scheduler.num_batches_in_flight(cfg.parallelism.pipeline)
        if num_in_flight > 1 or rank:  # a pipeline (stages as vLLM splits the layers), async
            kind = Rank if rank else PipelinedReplica
            if self.fast_forward and not rank:
                from sim.engine.fastpath.pipeline import FastPipelinedReplica

                kind = FastPipelinedReplica
            # Placeholders where the engine schedules ahead of its stages (async, overlap); a
            # plain pipeline waits for each token. Stale tokens as the engine treats them,
            # there only (checked by the golden schedules; a pipeline drops them).
            ahead = scheduler.output_placeholders and num_in_flight > cfg.parallelism.pipeline
            extra = {"stage_layers": [len(layers) for layers in
                                      cfg.parallelism.stage_layers(model.num_layers)],
                     "num_in_flight": num_in_flight, "placeholders": ahead,
                     "stale_delivered": ahead and scheduler.delivers_stale_tokens}
        copies = attach_cpu_tier(cfg, state, pool, field, str(self.source))
        host_copies = attach_host_cache(cfg, state, pool, field, str(self.source))
        replica = kind(self.env, len(self.replicas), scheduler, latency, state,
                       horizon_s=self.horizon_s, fast_forward=self.fast_forward, pool=pool,
                       quiet_until=self._next_arrival if pool == "colocated" else None,
                       where=(self.source, f"{field}.latency",
                              str(getattr(cfg.latency, "path", "")) or cfg.latency.kind),
                       noise=self._noise(cfg, latency, len(self.replicas), field),
                       start=not rank, **extra)
        replica.copies = copies
        replica.host_copies = host_copies
        self.replicas.append(replica)
        self.frontend_s.append(cfg.frontend_latency_s)
        return replica

    def _noise(self, cfg: ReplicaConfig, latency: LatencyModel, replica_id: int,
               field: str) -> IterationNoise | None:
        """The replica's jitter stream (seeded by the scenario's seed and the replica)."""
        noise = cfg.latency.noise
        if not noise.enabled:
            return None
        if not latency.accepts_noise:
            raise InputError(self.source, f"{field}.latency.noise.kind", noise.kind,
                             f"latency model {cfg.latency.kind!r} replays measured durations, "
                             "which carry their own jitter: noise on them would count it twice")
        quantiles = latency.noise_quantiles()
        if noise.kind == "empirical" and not quantiles:
            fix = ("fit the profile again (profiles fitted before servesim kept ratios have "
                   "none)" if cfg.latency.kind == "profile" else "use a profile")
            raise InputError(self.source, f"{field}.latency.noise.kind", "empirical",
                             f"latency model {cfg.latency.kind!r} keeps no measured ratios; "
                             f"{fix}, or lognormal noise with a sigma")
        return IterationNoise(noise, self.seed, replica_id, quantiles)

    def _next_arrival(self) -> float:
        """When the next request arrives or times out, or the horizon if sooner (nothing
        happens from then on). A colocated replica is read or changed only by arrivals (the
        router reads every replica's load) and timeouts, never by another replica."""
        horizon = self.horizon_s
        # With clients, any finish may send a request at once: nothing is quiet beyond the
        # next event of any kind (every replica's own runs ahead no further than that).
        arrival = self.env.peek() if self.reacting else self.env.next_arrival_s
        if self._deadlines:
            due = self._next_due()
            if due is not None and due.deadline_s < arrival:
                arrival = due.deadline_s
        return arrival if horizon is None or arrival < horizon else horizon

    def _next_due(self) -> Request | None:
        """The next request to time out that has not finished (or been rejected) yet."""
        deadlines = self._deadlines
        while deadlines and deadlines[0].status in DONE:
            deadlines.popleft()
        return deadlines[0] if deadlines else None

    def _timeouts(self) -> Generator[Any, Any, None]:
        """At each deadline of a request not finished yet, wake the replica holding it: it
        aborts the request before its next step (`ReplicaState.expire`), at once if idle."""
        env = self.env
        while True:
            due = self._next_due()
            if due is None:
                self._timeouts_idle = env.event()  # until a request that may time out arrives
                yield self._timeouts_idle
                self._timeouts_idle = None
                continue
            if due.deadline_s > env.now:
                yield At(env, due.deadline_s, NORMAL)
            while (due := self._next_due()) is not None and due.deadline_s <= env.now:
                self._deadlines.popleft()
                if self.disaggregation is not None and self.disaggregation.give_up(due):
                    if self.dispatcher is not None:
                        self.dispatcher.done(due, due.give_up_s, gave_up=True)
                    continue  # (it waited for its KV to be preallocated: in no replica yet)
                replica = self.replicas[due.replica_id]
                replica.sync()  # an iteration ending now may finish it in time
                if due.status in DONE:
                    continue
                replica.wake()
                if self.dispatcher is not None:  # it learns at the give-up, a front end later
                    self.dispatcher.done(due, due.give_up_s, gave_up=True)

    def run(self, requests: list[Request], on_progress: Progress | None = None,
            sessions: Sessions | None = None) -> None:
        """Simulate the arrivals to completion (or the horizon); check every replica after.
        With clients or `sessions` (whose turns wait for answers), requests are sent as they
        react (`sim.engine.clients`)."""
        if self.timeout_s is not None:
            self.env.process(self._timeouts())
        self.reacting = self.reacting or sessions is not None
        if not self.reacting:
            if (len(self.front) == 1 and self.disaggregation is None
                    and self.timeout_s is None and isinstance(self.front[0], Replica)):
                self.front[0].alone = True  # (only the trace's arrivals come to it)
            simulate(self.env, requests, self.route, self.horizon_s, on_progress)
        else:
            self._dispatch(requests, on_progress, sessions)
        for replica in self.replicas:
            if self.horizon_s is not None:
                replica.stop(self.horizon_s)
            replica.state.check()

    def _dispatch(self, requests: list[Request], on_progress: Progress | None,
                  sessions: Sessions | None) -> None:
        """Send the requests as clients and sessions react (`sim.engine.clients`), to the end
        or the horizon; a request never sent says why."""
        frontend_s = self.frontend_s
        self.dispatcher = dispatcher = Dispatcher(
            self.env, requests, self.route, lambda req: frontend_s[req.prefill_replica_id],
            np.random.default_rng(self._client_seed), clients=self.clients_config,
            sessions=sessions, on_progress=on_progress)
        for replica in self.replicas:
            replica.state.on_finish = self._finished
        dispatcher.start()
        self.env.run(until=self.horizon_s)
        dispatcher.mark_unsent(self.horizon_s)

    def _finished(self, req: Request) -> None:
        """`req` finished: its client learns at the instant of the finish, after every replica
        planned at that instant (`ANSWERED`), however the finish was committed: at the
        replica's turn, by a router looking at it, or ahead of the clock (fast-forward). The
        answers of one instant are told together, by request id: what their clients send is
        planned for together."""
        end_s = req.finish_s
        assert end_s is not None
        batch = self._answers.get(end_s)
        if batch is None:
            batch = self._answers[end_s] = []
            At(self.env, end_s, ANSWERED).callbacks.append(lambda _: self._answer(end_s))
        batch.append(req)

    def _answer(self, end_s: float) -> None:
        dispatcher = self.dispatcher
        assert dispatcher is not None
        for req in sorted(self._answers.pop(end_s), key=lambda r: r.request_id):
            dispatcher.done(req, end_s)

    def route(self, req: Request) -> None:
        """A request arrives: reject it if no decode replica could ever hold it, else route;
        with a client timeout, it gives up `timeout_s` from now."""
        if self.timeout_s is not None:
            req.give_up_s = req.arrival_s + self.timeout_s
            self._deadlines.append(req)
            if self._timeouts_idle is not None and not self._timeouts_idle.triggered:
                self._timeouts_idle.succeed()
        if self.disaggregation is not None:
            reason = self.disaggregation.reject_reason(req)
            if reason is not None:
                req.status, req.reason = Status.REJECTED, reason
                return
        front = self.front
        index = 0 if len(front) == 1 else self.router.choose(
            req, Loads(front, req if self.router.needs_prefix_hits else None))
        if self.timeout_s is not None:  # its answer must leave the engine a front end earlier
            req.deadline_s = req.give_up_s - self.frontend_s[front[index].replica_id]
        if self.disaggregation is not None:
            self.disaggregation.submit(req, front[index])
        else:
            front[index].submit(req)


class Loads(LazyLoads):
    """The replicas' loads as a router reads them, each taken when first read: reading a
    replica's load commits the work it has finished (`Replica.sync`), which a router that does
    not look (round robin, random) need not pay for."""

    def __init__(self, replicas: list[Replica], req: Request | None) -> None:
        self.replicas = replicas
        self.req = req
        self.loads: list[ReplicaLoad | None] = [None] * len(replicas)

    def __len__(self) -> int:
        return len(self.replicas)

    def __iter__(self) -> Iterator[ReplicaLoad]:
        # Routers that weigh loads read every replica's at every arrival: without this,
        # `Sequence.__iter__` goes through `__getitem__` and ends on an IndexError.
        loads, replicas, req = self.loads, self.replicas, self.req
        for i, load in enumerate(loads):
            if load is None:
                load = loads[i] = replicas[i].load(req)
            yield load

    def load_tokens(self) -> list[int]:
        if self.req is not None:  # (prefix hits: each whole load, as read)
            return super().load_tokens()
        return [replica.load_tokens() if load is None else load.num_load_tokens
                for replica, load in zip(self.replicas, self.loads, strict=True)]

    @overload
    def __getitem__(self, index: int) -> ReplicaLoad: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[ReplicaLoad]: ...

    def __getitem__(self, index: int | slice) -> ReplicaLoad | Sequence[ReplicaLoad]:
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        load = self.loads[index]
        if load is None:
            load = self.loads[index] = self.replicas[index].load(self.req)
        return load


def make_latency(cfg: ReplicaConfig, model: ModelShape, source: str,
                 field: str = "replica") -> LatencyModel:
    """The replica's latency model. A split replica's parallelism is passed only to models
    that take it: one written for a single GPU is refused for a split, not run as if whole."""
    cls = LATENCY_MODELS.get(cfg.latency.kind)
    takes = "parallelism" in inspect.signature(cls.__init__).parameters
    # (A model of one GPU may time each data-parallel rank of one GPU: the ranks' steps then
    # go at the slowest one's pace, `LatencyModel.lockstep_time_s`.)
    split = cfg.parallelism.num_gpus > 1 and takes
    if cfg.parallelism.num_gpus_per_rank > 1 and not takes:
        raise InputError(source, f"{field}.parallelism", cfg.parallelism.model_dump(),
                         f"latency model {cfg.latency.kind!r} does not model a replica "
                         "split over GPUs")
    try:
        if not split:
            latency = cls(cfg.latency, model, cfg.gpu_spec)
        else:
            latency = cls(cfg.latency, model, cfg.gpu_spec, parallelism=cfg.parallelism)
        spec = getattr(cfg.scheduler, "speculative", None)
        if spec is not None:
            ratio, prompt_ratio = spec.draft_time_ratio, None
            if ratio is None:  # (the default drafters' passes: weights read, compute over prompts)
                ratio = drafter_time_ratio(spec.method, model)
                prompt_ratio = drafter_prompt_ratio(spec.method, model)
            if ratio and spec.engine == "sglang":
                latency = cast(LatencyModel, EagleDraftingLatency(
                    latency, ratio, spec.num_steps, spec.eagle_topk, prompt_ratio))
            elif ratio:
                latency = cast(LatencyModel, DraftingLatency(
                    latency, ratio, spec.num_speculative_tokens, prompt_ratio,
                    spec.drafts_by_batch_size(cfg.scheduler.max_num_seqs)))
        if cfg.latency.scale != 1.0:
            return cast(LatencyModel, ScaledLatency(latency, cfg.latency.scale))
        return latency
    except InputError as exc:
        if exc.source != "<scenario>":
            # A file the latency settings name (a communication table): its field named in
            # full, so that a pool's replica is told from the other's.
            if all(name.startswith("latency.") for name, _, _ in exc.problems):
                raise exc.moved(exc.source, lambda name: f"{field}.{name}") from None
            raise
        # A model's own problem with the replica (e.g. a profile measured for another split),
        # named relative to the replica: placed in the scenario here.
        raise exc.moved(source, lambda name: f"{field}.{name}") from None


def make_scheduler(cfg: ReplicaConfig, role: Role = "colocated", rank: bool = False
                   ) -> Scheduler:
    """The replica's scheduler (with `rank`, one data-parallel rank's: `for_rank`), knowing
    the context window in force, with the defaults its engine derives from the KV pool
    (`resolved_scheduler`) in its pool (`role`)."""
    config = resolved_scheduler(cfg, role)
    if rank:
        config = config.for_rank(cfg.parallelism.data)
    return SCHEDULERS.get(cfg.scheduler.name)(config, max_model_len=cfg.context_len)


def resolved_scheduler(cfg: ReplicaConfig, role: Role = "colocated") -> SchedulerConfig:
    """The replica's scheduler settings with the defaults its engine derives from GPU memory
    and its KV pool filled in (SGLang's `mem_fraction_static`, `sglang_mem_fraction`; then
    `SchedulerConfig.for_kv`: SGLang's running limit); as given where the pool has no room
    (`kv_cache_for` says why)."""
    scheduler = cfg.scheduler
    fraction = sglang_mem_fraction(cfg, role)
    if fraction is not None and getattr(scheduler, "mem_fraction_static", 0) is None:
        scheduler = scheduler.model_copy(update={"mem_fraction_static": fraction})
    if not scheduler.derives_from_kv:
        return scheduler
    num_null = SCHEDULERS.get(scheduler.name).num_null_blocks
    num_blocks = num_kv_blocks(cfg, cfg.model_shape, num_null, role)
    if num_blocks <= 0:
        return scheduler
    return scheduler.for_kv(num_blocks * cfg.kv_cache.block_size, cfg.context_len,
                            cfg.parallelism.data)


def role_of(field: str) -> Role:
    """The pool a replica's field names (`_field`): colocated, prefill or decode."""
    if field == "cluster.prefill.replica":
        return "prefill"
    return "decode" if field == "cluster.decode.replica" else "colocated"


def sglang_mem_fraction(cfg: ReplicaConfig, role: Role = "colocated") -> float | None:
    """An `sglang` replica's `--mem-fraction-static` where its KV pool is sized from memory:
    given, or SGLang 0.5.23's default for its GPU, chunk, TP x PP and pool
    (`sim.schedulers.sglang_memory`); None for other schedulers or blocks given."""
    scheduler = cfg.scheduler
    if not isinstance(scheduler, SGLangConfig) or cfg.kv_cache.num_blocks is not None:
        return None
    if scheduler.mem_fraction_static is not None:
        return scheduler.mem_fraction_static
    model, par, spec = cfg.model_shape, cfg.parallelism, scheduler.speculative
    return default_mem_fraction_static(MemoryInputs(
        gpu=cfg.gpu_spec, tensor=par.tensor * par.data, pipeline=par.pipeline,
        chunked_prefill_size=scheduler.chunked_prefill_size,
        max_running_requests=scheduler.given_max_running_requests,
        num_draft_tokens=None if spec is None else spec.num_draft_tokens,
        mla=model.is_mla, llama2="llama-2" in cfg.model_name.lower(),
        context_len=cfg.context_len, role=role, num_dp_ranks=par.data))


def num_kv_blocks(cfg: ReplicaConfig, model: ModelShape, num_null: int,
                  role: Role = "colocated") -> int:
    """The replica's KV blocks the engine allocates: those given, or what GPU memory holds
    after the weights (`kv_cache_for`; SGLang's rule for `sglang`, `sglang_mem_fraction`),
    less `num_null` it never allocates; at most 0 where there is no room."""
    kv = cfg.kv_cache
    if kv.num_blocks is not None:
        return kv.num_blocks - num_null
    weight_bytes, kv_bytes = _bytes_per_gpu(cfg, model)
    fraction = sglang_mem_fraction(cfg, role)
    if fraction is not None:
        tokens = kv_pool_tokens(cfg.gpu_spec, fraction, weight_bytes, kv_bytes, kv.block_size)
        return tokens // kv.block_size - num_null
    usable_bytes = cfg.gpu_spec.memory_bytes * kv.gpu_memory_utilization
    free_bytes = usable_bytes - weight_bytes - kv.activation_reserve_gb * 1e9
    return int(free_bytes // (kv.block_size * kv_bytes)) - num_null


def _bytes_per_gpu(cfg: ReplicaConfig, model: ModelShape) -> tuple[float, float]:
    """The busiest GPU's weight bytes (a drafter's and DeepEP's buffers included) and KV bytes
    per token slot."""
    par = cfg.parallelism
    weight_bytes = par.weight_bytes_per_gpu(model, cfg.lm_head_ranks)
    kv_bytes = par.kv_bytes_per_token_per_gpu(model)
    spec = getattr(cfg.scheduler, "speculative", None)
    if spec is not None and spec.method in ("eagle", "eagle3", "mtp"):
        # A one-layer drafter keeps its KV in the same pool, a slot per token slot (SGLang's
        # pool configurator: the cell grows by draft layers / target layers; vLLM's KV cache
        # groups), and its layer's weights beside the target's (EAGLE-3's own small LM head
        # and input projection left out). A draft model's are its own: not counted.
        kv_bytes *= 1 + 1 / model.num_layers
        weight_bytes += par.dense_layer_bytes_per_gpu(model)
    backend = getattr(cfg.latency, "all2all_backend", None)
    if backend is not None and par.data > 1 and model.num_experts:
        # DeepEP's buffers, allocated before vLLM sizes its KV cache.
        from sim.latency.all_to_all import deepep_buffer_bytes

        weight_bytes += deepep_buffer_bytes(backend, hidden_size=model.hidden_size,
                                            num_experts=model.num_experts,
                                            num_gpus=par.data * par.tensor)
    return weight_bytes, kv_bytes


def kv_cache_for(cfg: ReplicaConfig, model: ModelShape, field: str = "replica",
                 source: str = "<scenario>", scheduler: Scheduler | None = None
                 ) -> KVCacheManager:
    """The replica's KV cache: the blocks given, or what GPU memory holds after the weights,
    less the blocks `scheduler`'s engine never allocates (vLLM's null block); with prefix
    caching, evicting unused prefixes in the scheduler's engine's order. Memory is counted per
    GPU, as vLLM does: each holds its share of the weights and of every token's KV, so the
    most loaded GPU bounds the replica."""
    eviction: Eviction = "lru_block" if scheduler is None else scheduler.prefix_cache_eviction
    num_null = 0 if scheduler is None else scheduler.num_null_blocks
    kv = cfg.kv_cache
    gpu, par = cfg.gpu_spec, cfg.parallelism
    # (the busiest GPU's, as vLLM shards them)
    weight_bytes = par.weight_bytes_per_gpu(model, cfg.lm_head_ranks)
    if kv.num_blocks is not None:
        # Blocks given (vLLM's `num_gpu_blocks_override`) skip the memory budget; the weights
        # must still fit, or the deployment could not exist. More blocks than the rest of
        # memory holds are allowed (an idealised cache) and said in the summary
        # (`blocks_beyond_memory`).
        if weight_bytes > gpu.memory_bytes:
            split = f" split {par.num_gpus} ways" if par.num_gpus > 1 else ""
            raise InputError(source, f"{field}.kv_cache.num_blocks", kv.num_blocks,
                             f"{model.name}{split} needs {weight_bytes / 2**30:.1f} GiB of "
                             f"weights per GPU; a {gpu.name} holds "
                             f"{gpu.memory_bytes / 2**30:.1f} GiB: raise parallelism.tensor "
                             "or pick a larger GPU")
        if kv.num_blocks <= num_null:
            raise InputError(source, f"{field}.kv_cache.num_blocks", kv.num_blocks,
                             f"the engine keeps {num_null} block(s) it never allocates (vLLM's "
                             f"null block): give more than {num_null}")
        return _manager(cfg, kv.num_blocks - num_null, eviction)
    role = role_of(field)
    num_blocks = num_kv_blocks(cfg, model, num_null, role)
    if num_blocks <= 0:
        need_bytes = _bytes_per_gpu(cfg, model)[0]
        split = f" split {par.num_gpus} ways (TP{par.tensor} x PP{par.pipeline})" \
            if par.num_gpus > 1 else ""
        fraction = sglang_mem_fraction(cfg, role)
        if fraction is not None:
            static_bytes = pre_load_bytes(gpu) * fraction
            raise InputError(source, f"{field}.kv_cache", f"{model.name} on {gpu.name}",
                             f"no room for KV: weights{split} need {need_bytes / 2**30:.1f} "
                             f"GiB per GPU, SGLang's static memory is "
                             f"{static_bytes / 2**30:.1f} GiB (scheduler.mem_fraction_static "
                             f"{fraction:g} of the {pre_load_bytes(gpu) / 2**30:.1f} GiB free "
                             "before loading); raise parallelism.tensor or pick a larger GPU")
        usable_bytes = gpu.memory_bytes * kv.gpu_memory_utilization
        raise InputError(source, f"{field}.kv_cache", f"{model.name} on {gpu.name}",
                         f"no room for KV: weights{split} need {need_bytes / 2**30:.1f} GiB "
                         f"per GPU plus {kv.activation_reserve_gb * 1e9 / 2**30:.1f} GiB for "
                         f"activations (activation_reserve_gb {kv.activation_reserve_gb:g}), "
                         f"{usable_bytes / 2**30:.1f} GiB usable of {gpu.memory_bytes / 2**30:.1f}"
                         f" GiB (gpu_memory_utilization {kv.gpu_memory_utilization:g}); "
                         "raise parallelism.tensor or pick a larger GPU")
    return _manager(cfg, num_blocks, eviction)


def blocks_beyond_memory(cfg: ReplicaConfig) -> str | None:
    """If the replica's KV blocks are given and, with the weights, exceed its GPUs' memory:
    by how much (an idealised cache, e.g. to find every reuse a trace holds); else None."""
    kv, gpu, par, model = cfg.kv_cache, cfg.gpu_spec, cfg.parallelism, cfg.model_shape
    if kv.num_blocks is None:
        return None
    need_bytes = (par.weight_bytes_per_gpu(model, cfg.lm_head_ranks)
                  + kv.num_blocks * kv.block_size * par.kv_bytes_per_token_per_gpu(model))
    if need_bytes <= gpu.memory_bytes:
        return None
    return (f"{kv.num_blocks:,} KV blocks given: with the weights, {need_bytes / 2**30:,.1f} "
            f"GiB per GPU, of {gpu.memory_bytes / 2**30:,.1f} GiB on a {gpu.name}")


def _manager(cfg: ReplicaConfig, num_blocks: int, eviction: Eviction) -> KVCacheManager:
    if cfg.prefix_caching and eviction in ("lru_block", "fifo_block"):  # vLLM's, by block
        return BlockPrefixCache(num_blocks, cfg.kv_cache.block_size, eviction)
    if cfg.prefix_caching and getattr(cfg.scheduler, "hierarchical_cache", None) is not None:
        threshold = write_threshold(cfg)
        return HierarchicalCache(num_blocks, cfg.kv_cache.block_size,
                                 host_cache_blocks(cfg, num_blocks), threshold,
                                 write_back=not threshold)
    if cfg.prefix_caching:  # SGLang's radix cache
        return PrefixCachingKVManager(num_blocks, cfg.kv_cache.block_size)
    return KVCacheManager(num_blocks, cfg.kv_cache.block_size)
