"""Run a scenario end to end: load the workload, build the cluster, simulate, collect, write."""

from __future__ import annotations

import gc
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from sim.config.replica import ReplicaConfig
from sim.config.scenario import Scenario, load_scenario, with_pool_replicas, with_prefix_caching
from sim.core.kv_cache import KVCacheManager
from sim.core.request import Request
from sim.core.speculative import Acceptance
from sim.engine.clock import Progress
from sim.engine.cluster import Cluster, blocks_beyond_memory, resolved_scheduler
from sim.engine.cpu_tier import offload_facts
from sim.engine.iteration_log import IterationLog
from sim.hardware.gpus import measured_on
from sim.results.columns import Columns, Table, column
from sim.results.metrics.arrived import arrived_stats
from sim.results.metrics.classes import class_columns, class_gaps, class_summary, priorities_ignored
from sim.results.metrics.offload import offload_stats, pool_offload_stats
from sim.results.metrics.overload import overload
from sim.results.metrics.sessions import session_stats
from sim.results.metrics.speculative import speculative_stats
from sim.results.metrics.stages import stage_stats
from sim.results.metrics.summary import (
    FINISHED,
    WeightedSample,
    finished_distribution,
    gap_table,
    never_arrived,
    pool_stats,
    prefix_cache_stats,
    replica_stats,
    summarize,
    transfer_stats,
)
from sim.results.metrics.warmup import generated_arrivals, warmup_stats
from sim.results.outdir import check_out_dir
from sim.results.records import (
    iteration_table,
    request_table,
    token_runs,
    token_table,
    token_times,
)
from sim.results.run_dir import Results
from sim.schedulers import SCHEDULERS
from sim.schedulers.sglang_memory import Role
from sim.workloads import Workload
from sim.workloads.base import Sessions
from sim.workloads.load import load_workload


@dataclass(frozen=True)
class ReplicaRecord:
    """What the results need of one replica once it has run."""

    pool: str  # colocated, prefill or decode
    log: IterationLog
    kv: KVCacheManager
    acceptance: Acceptance | None = None  # speculative decoding's draws and counts
    offload: dict[str, float] | None = None  # the KV cache's CPU tier (`offload_facts`)


def _split_name(cfg: ReplicaConfig) -> str:
    """`TP4`, `TP2xPP2`, `TP8xEP8`, `DP2xTP1xEP2`: the replica's split, as people write it
    (`TP1` alone)."""
    par = cfg.parallelism
    parts = [f"DP{par.data}"] if par.data > 1 else []
    parts += [f"TP{par.tensor}"]
    parts += [f"PP{par.pipeline}"] if par.pipeline > 1 else []
    parts += [f"EP{par.expert}"] if par.expert > 1 else []
    return "x".join(parts)


def _precision(cfg: ReplicaConfig) -> str:
    """What a replica stores in fp8 ("" for neither)."""
    parts = (["fp8 weights"] if cfg.quantization == "fp8" else []) + (
        ["fp8 KV"] if cfg.kv_cache.dtype != "auto" else [])
    return ", ".join(parts)


def _dummy_forwards(cluster: Any) -> int | None:
    """Dummy batches the data-parallel ranks ran (None: no such replica)."""
    from sim.engine.data_parallel import DataParallelGroup

    groups = [g for g in [*cluster.front, *cluster.decode] if isinstance(g, DataParallelGroup)]
    return sum(g.num_dummy_forwards for g in groups) if groups else None


def cost_stats(summary: dict[str, Any], requests: Table,
               pools: dict[str, ReplicaConfig], replicas: Sequence[ReplicaRecord]
               ) -> dict[str, Any]:
    """GPUs the cluster occupies, what they cost an hour, and per GPU and per million tokens
    what the run's throughput makes of it (Vidur-Search's measures). Cost is None where a GPU
    has no price."""
    num_gpus = 0
    usd_per_hour: float | None = 0.0
    for pool, cfg in pools.items():
        # (A record per engine: a data-parallel replica's ranks, each on its share of GPUs.)
        n = sum(r.pool == pool for r in replicas) * cfg.parallelism.num_gpus_per_rank
        num_gpus += n
        price = cfg.gpu_spec.cost_per_gpu_hour
        usd_per_hour = None if price is None or usd_per_hour is None else usd_per_hour + n * price
    thr = summary["throughput"]
    span_s = thr["span_s"]
    # Tokens served: the prompts prefilled (a first token came out) and every token generated.
    generated = column(requests, "num_generated_tokens")
    num_tokens = float(column(requests, "num_prompt_tokens")[generated > 0].sum()
                       + generated.sum())
    output_per_s = thr["output_tokens_per_s"]
    tokens_per_s = num_tokens / span_s if span_s > 0 else None

    def per_million(rate: float | None) -> float | None:
        if usd_per_hour is None or not rate:
            return None
        return usd_per_hour / (rate * 3600) * 1e6

    per_request = per_million(thr["requests_per_s"])
    return {
        "num_gpus": num_gpus,
        "usd_per_hour": usd_per_hour,
        "requests_per_s_per_gpu": (thr["requests_per_s"] / num_gpus
                                   if thr["requests_per_s"] is not None else None),
        "output_tokens_per_s_per_gpu": (output_per_s / num_gpus
                                        if output_per_s is not None else None),
        "usd_per_million_output_tokens": per_million(output_per_s),
        "usd_per_million_tokens": per_million(tokens_per_s),
        "usd_per_request": None if per_request is None else per_request / 1e6,
    }


def cluster_gpus(scenario: Scenario) -> int:
    """GPUs the scenario's cluster occupies: replicas times GPUs per replica, every pool."""
    return sum(pool.num_replicas * pool.replica.parallelism.num_gpus
               for pool in scenario.pools())


def pool_configs(scenario: Scenario) -> dict[str, ReplicaConfig]:
    """Each pool's replica configuration: one colocated pool, or prefill and decode."""
    return {pool.name: pool.replica for pool in scenario.pools()}


def make_requests(workload: Workload, priorities: Sequence[int] = (), *,
                  ignore_eos: bool = True) -> list[Request]:
    """The workload's requests; `priorities[c]`: the priority of class c (`request_class`);
    `ignore_eos`: the client's (`WorkloadConfig.ignore_eos`)."""
    hash_ids = workload.hash_ids
    hash_block_tokens = workload.hash_block_tokens
    requests = [
        Request(i, float(t), int(p), int(o), hash_ids[i] if hash_ids is not None else None,
                hash_block_tokens if hash_ids is not None else 0)
        for i, (t, p, o) in enumerate(zip(workload.arrival_s.tolist(),
                                          workload.num_prompt_tokens.tolist(),
                                          workload.num_output_tokens.tolist(), strict=True))
    ]
    if workload.request_class is not None:
        for req, c in zip(requests, workload.request_class.tolist(), strict=True):
            req.request_class = c
            req.priority = priorities[c] if priorities else 0
    if not ignore_eos:
        for req in requests:
            req.ignore_eos = False
    return requests


# Runs with at least this many requests free them with a full collection (`run_scenario`).
COLLECT_AT_NUM_REQUESTS = 100_000


@contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic garbage collection inside (as it was after, if it was on)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def mark_after_horizon(requests: Sequence[Request], horizon_s: float | None) -> list[Request]:
    """The requests that arrive before the horizon; the others get their reason (they appear
    in the results as unfinished, never dropped)."""
    if horizon_s is None:
        return list(requests)
    arrived = []
    for req in requests:
        if req.arrival_s < horizon_s:
            arrived.append(req)
        else:
            req.reason = f"after_horizon: arrives at {req.arrival_s:.6g} s"
    return arrived


def run_scenario(scenario: Scenario | str | Path | None = None, *, seed: int | None = None,
                 out_dir: str | Path | None = None, fast_forward: bool = True,
                 on_progress: Progress | None = None) -> Results:
    """Simulate a scenario (a `Scenario`, a YAML path, or None for the embedded default).

    `seed` overrides the scenario's; `out_dir`, if given, receives the result files (checked
    before the simulation starts). `fast_forward=False` steps every iteration (slow; for
    checking the fast path). `on_progress(arrived, total)` is called as requests arrive."""
    if not isinstance(scenario, Scenario):
        scenario = load_scenario(scenario)
    if seed is not None:
        scenario = scenario.model_copy(update={"seed": seed})
    if out_dir is not None:
        check_out_dir(Path(out_dir))
    workload = load_workload(scenario)
    given, scenario = scenario, with_prefix_caching(scenario, workload.hash_ids is not None)
    # The defaults an engine derives from its KV pool (SGLang's running limit), spelled out
    # in the resolved scenario as the replicas will have them.
    # (SGLang's static memory fraction first: each pool's, as its server resolves it.)
    scenario = with_pool_replicas(scenario, lambda replica, pool: replica.model_copy(
        update={"scheduler": resolved_scheduler(replica, cast(Role, pool))}))
    # Pools whose engine caches prefixes by default, left off for want of hash ids.
    left_off = [(pool.field, pool.replica.scheduler.name)
                for pool, was in zip(scenario.pools(), given.pools(), strict=True)
                if was.replica.prefix_caching is None and not pool.replica.prefix_caching
                and type(pool.replica.scheduler).prefix_caching_default]
    # A million requests are a million objects, none in a cycle, that each full collection
    # goes over; making them starts one per 25% more objects (2.7 s of 3.7 for a million).
    classes = scenario.workload.classes or []
    with collector_paused():
        requests = make_requests(workload, [c.priority for c in classes],
                                 ignore_eos=scenario.workload.ignore_eos)
    stage, sessions = workload.stage, workload.sessions
    del workload
    cluster = Cluster(scenario, fast_forward=fast_forward)
    # Clients and sessions send each request when they can: the horizon tells which never went.
    reacting = scenario.clients is not None or sessions is not None
    cluster.run(requests if reacting else mark_after_horizon(requests, scenario.horizon_s),
                on_progress, sessions)
    records = [ReplicaRecord(r.pool, r.log, r.state.kv, r.state.acceptance,
                             offload_facts(r.state, r.copies) if r.copies is not None else
                             r.host_copies.facts() if r.host_copies is not None else None)
               for r in cluster.replicas]
    latency = cluster.replicas[0].latency.describe()
    dummy = _dummy_forwards(cluster)
    frames = request_results(scenario, requests, [r.log for r in records])
    frames.stage = stage
    frames.sessions = sessions
    # Many requests (0.6 GB for a million, with their token runs) go before the summary and
    # the iteration frame are made, the peak otherwise (1.65 GB, not 1.98, for a million).
    # The cluster holds them too, in reference cycles (a replica and its SimPy process) that
    # only a full collection frees: worth its time (~2.5 s a million) only for many.
    num_requests = len(requests)
    del requests, cluster
    if num_requests >= COLLECT_AT_NUM_REQUESTS:
        gc.collect()
    results = collect_frames(scenario, frames, records, latency)
    # (The summary's count of preemptions: the request table as a DataFrame would import
    # pandas, which a simulation never does.)
    if left_off and (note := _left_off_note(left_off, results.summary,
                                            results.summary["num_preemptions"])):
        results.summary["run"]["prefix_caching_left_off"] = note
    if dummy is not None:
        ranks = {pool.name: pool.replica.parallelism.data for pool in scenario.pools()}
        results.summary["data_parallel"] = {
            # (the most of any pool's; `ranks_per_pool` says each in a disaggregated cluster)
            "ranks_per_replica": max(ranks.values()),
            **({"ranks_per_pool": ranks} if len(ranks) > 1 else {}),
            "num_dummy_forwards": dummy,
            "note": "a rank's dummy batches (vLLM) or idle forwards (SGLang), while another "
                    "rank ran or, in vLLM, the ranks had yet to find all idle, are not rows of "
                    "iterations.parquet: busy fractions leave them out"}
    if out_dir is not None:
        results.write(out_dir)
    return results


CLIENT_COLUMNS = ("client_ttft_s", "client_e2e_s")
# KV use from which SGLang's admission check with its radix cache may decide otherwise.
NEAR_FULL_KV = 0.9


def _left_off_note(left_off: list[tuple[str, str]], summary: dict[str, Any],
                   num_preemptions: int) -> str | None:
    """What a prefix cache left off for want of hash ids may have changed, where the run shows
    it could (else None): preempted requests, whose own blocks the engine's default cache
    keeps for their return; and, under SGLang, a KV cache near full, where its radix cache's
    admission check differs from the one without it."""
    why = []
    if num_preemptions:
        why.append(f"{num_preemptions:,} preemptions here, whose requests' own blocks the "
                   "engine's default prefix cache would keep for their return")
    full = max((r["max_kv_utilization"] or 0.0) for r in summary["replicas"])
    if any(name == "sglang" for _, name in left_off) and full >= NEAR_FULL_KV:
        why.append(f"KV use up to {full:.0%}, where SGLang's admission check with its radix "
                   "cache differs from the one without")
    if not why:
        return None
    fields = ", ".join(f"{field}.prefix_caching" for field, _ in left_off)
    return (f"{fields} left off (no request names prefixes); {'; '.join(why)}: set "
            "prefix_caching: true")
def calibration_facts(pools: dict[str, ReplicaConfig]) -> dict[str, Any]:
    """Which engine calibration made the run (the first pool's; each pool's front end), where
    it came from and how far it is from measured runs."""
    from sim.config.engine import band_facts

    cal = next(iter(pools.values())).calibration
    return {"name": cal.name, "engine": cal.engine, "gpu": cal.gpu,
            "frontend_s": {pool: cfg.frontend_latency_s for pool, cfg in pools.items()},
            "provenance": cal.provenance, "error": cal.error,
            "bands": {pool: band_facts(cfg.calibration, cfg.measured_gpu)
                      for pool, cfg in pools.items()}}


def client_latencies(requests: Columns, configs: Sequence[ReplicaConfig]) -> Columns:
    """TTFT and E2E as a client sees them: the engine's plus the API front end of the replica
    that took the request (`configs[i]` is replica i's; its engine calibration's
    `frontend_latency_s`). A constant per replica: it shifts when a request reaches the engine
    and when its tokens reach the client, and so no token gap (TPOT, TBT)."""
    frontend_s = np.array([c.frontend_latency_s for c in configs] + [np.nan])
    replica = column(requests, "replica_id")  # -1 (never on a replica): NaN, the last entry
    added_s = frontend_s[np.where(replica >= 0, replica, len(configs))]
    return {"client_ttft_s": column(requests, "ttft_s") + added_s,
            "client_e2e_s": column(requests, "e2e_s") + added_s}


@dataclass
class RequestResults:
    """What the results take from the requests themselves, which may go once this is made."""

    requests: Columns
    gaps: WeightedSample | None  # every TBT gap, pooled; None once the summary has it
    tokens: Columns | None  # one row per token, if the scenario records token times
    stage: np.ndarray | None = None  # each request's load stage, if sent in stages
    sessions: Sessions | None = None  # each request's session and turn, if it has them
    request_class: np.ndarray | None = None  # each request's class, if classes are given
    class_gaps: list[WeightedSample] | None = None  # the TBT gaps of each class, pooled


def request_results(scenario: Scenario, requests: Sequence[Request],
                    logs: Sequence[IterationLog]) -> RequestResults:
    """The request table and pooled TBT gaps from the requests' token runs: nothing here holds
    one entry per token (a million requests generate some 200 million), unless the tokens
    table is asked for."""
    runs = token_runs(requests, logs)  # once: the tokens table reads them too
    request_cols, gaps = request_table(requests, logs, runs)
    tokens = (token_table(requests, *token_times(requests, logs, runs))
              if scenario.record_token_times else None)
    results = RequestResults(request_cols, gaps, tokens)
    if classes := scenario.workload.classes:
        index = np.fromiter((r.request_class for r in requests), np.int64, len(requests))
        results.request_class = index
        results.class_gaps = class_gaps(index, len(classes), runs, runs.times_s(logs))
    return results


def collect(scenario: Scenario, requests: Sequence[Request], replicas: Sequence[ReplicaRecord],
            latency: dict[str, Any], end_s: float | None = None) -> Results:
    """Turn requests and replica logs into result tables and the summary. `end_s` is when the
    run stopped (default: the horizon, or the last thing that happened)."""
    frames = request_results(scenario, requests, [r.log for r in replicas])
    return collect_frames(scenario, frames, replicas, latency, end_s)


def collect_frames(scenario: Scenario, frames: RequestResults,
                   replicas: Sequence[ReplicaRecord], latency: dict[str, Any],
                   end_s: float | None = None) -> Results:
    """`collect`, once the requests' tables are made (their gaps are taken out of `frames`)."""
    logs = [r.log for r in replicas]
    request_cols, gaps = frames.requests, frames.gaps
    assert gaps is not None, "collect_frames takes the gaps: once per RequestResults"
    frames.gaps = None
    pools = pool_configs(scenario)
    request_cols.update(client_latencies(request_cols, [pools[r.pool] for r in replicas]))
    if frames.stage is not None:
        request_cols["stage"] = frames.stage
    if frames.sessions is not None:
        request_cols["session"] = frames.sessions.session
        request_cols["turn"] = frames.sessions.turn
    if frames.request_class is not None:
        request_cols.update(class_columns(frames.request_class, scenario))
    # The summary before the iteration table exists, and the gaps dropped before it is made:
    # the peak memory is the two tables, with nothing beside them.
    summary = summarize(request_cols, sum(len(log) for log in logs), gaps, scenario.slo)
    done = column(request_cols, "status") == FINISHED
    for name in CLIENT_COLUMNS:
        summary[name] = finished_distribution(column(request_cols, name)[done])
    gap_cols = gap_table(gaps)
    del gaps
    iteration_cols = iteration_table(logs, [r.pool for r in replicas])
    if end_s is None:
        end_s = scenario.horizon_s
    if end_s is None:
        last = [float(log.end_s()[-1]) for log in logs if len(log)]
        # Requests never sent (a session abandoned) keep the times they were due: not an end.
        arrival = column(request_cols, "arrival_s")[~never_arrived(request_cols)]
        end_s = max([*last, float(arrival.max()) if len(arrival) else 0.0])
    summary["replicas"] = replica_stats(iteration_cols, {i: r.kv.num_blocks
                                                       for i, r in enumerate(replicas)}, end_s)
    for stats, replica in zip(summary["replicas"], replicas, strict=True):
        # Zero when every request is done: prefill blocks freed after each transfer, decode
        # blocks at completion; with a CPU tier, but those of finished requests whose stores
        # vLLM has not polled yet.
        stats["kv_blocks_in_use_at_end"] = replica.kv.num_used_blocks
        if replica.offload is not None:
            stats["kv_blocks_awaiting_stores_at_end"] = int(
                replica.offload["num_blocks_awaiting_stores"])
    summary["pools"] = pool_stats(summary["replicas"])
    if any(r.pool == "decode" for r in replicas):
        summary["transfer"] = transfer_stats(request_cols)
        # Where the client's first token leaves from: the hand-off lies between it and the
        # second only where it is the prefill replica's (`Scheduler.prefill_first_token`).
        prefill = scenario.cluster.prefill
        assert prefill is not None
        first = SCHEDULERS.get(prefill.replica.scheduler.name).prefill_first_token
        summary["transfer"]["first_token_from"] = "prefill" if first == "client" else "decode"
    if scenario.clients is not None and not scenario.clients.paced:
        # The load follows the server: each client waits for its answer before sending again.
        summary["overload"] = {
            "verdict": "stable",
            "detail": f"closed loop: {scenario.clients.concurrency:,} clients, at most that "
                      "many requests in flight; the load follows the server, so queues cannot "
                      "grow past them (throughput and latency at that concurrency are the "
                      "answer)"}
    else:
        summary["overload"] = overload(request_cols, end_s)
    if frames.stage is not None:
        summary["stages"] = stage_stats(request_cols, scenario, end_s)
    if frames.sessions is not None:
        summary["sessions"] = session_stats(request_cols)
    if frames.class_gaps is not None:
        summary.update(class_summary(request_cols, frames.class_gaps, scenario))
        frames.class_gaps = None
    summary.update(arrived_stats(request_cols, end_s))
    clients = scenario.clients
    summary.update(warmup_stats(request_cols, end_s, summary["overload"],
                                generated_arrivals(scenario.workload, clients),
                                clients.warmup_requests if clients is not None else 0))
    if any(r.kv.caches_prefixes for r in replicas):
        summary["prefix_cache"] = prefix_cache_stats(request_cols, [r.kv for r in replicas])
    if acceptances := [r.acceptance for r in replicas if r.acceptance is not None]:
        summary["speculative"] = speculative_stats(acceptances)
        # (The decode pool's, on a disaggregated cluster: its replicas verify the drafts.)
        spec = (pools["decode"] if "decode" in pools else next(iter(pools.values()))
                ).scheduler.speculative  # type: ignore[attr-defined]
        if spec.engine == "sglang":  # SGLang's own numbers, as its server logs name them
            summary["speculative"].update(
                engine="sglang", algorithm=spec.algorithm, num_steps=spec.num_steps,
                eagle_topk=spec.eagle_topk, num_draft_tokens=spec.num_draft_tokens)
    if facts := [r.offload for r in replicas if r.offload is not None]:
        summary["kv_offload"] = offload_stats(request_cols, facts)
        by_pool: dict[str, list[dict[str, float]]] = {}
        for r in replicas:
            if r.offload is not None:
                by_pool.setdefault(r.pool, []).append(r.offload)
        if "decode" in by_pool:  # (its tier's own counts beside the prefill pool's)
            summary["kv_offload"]["pools"] = pool_offload_stats(by_pool)
    summary["run"] = {
        "scenario": scenario.name,
        "seed": scenario.seed,
        "model": next(iter(pools.values())).model_name,
        "gpu": "/".join(cfg.gpu_name for cfg in pools.values()),
        "parallelism": "/".join(_split_name(cfg) for cfg in pools.values()),
        "scheduler": "/".join(cfg.scheduler.name for cfg in pools.values()),
        "latency": "/".join(cfg.latency.kind for cfg in pools.values()),
        "engine": "/".join(dict.fromkeys(cfg.calibration.name for cfg in pools.values())),
        # Replicas per pool (a data-parallel replica's ranks are one replica).
        "pools": {pool: sum(r.pool == pool for r in replicas) // cfg.parallelism.data
                  for pool, cfg in pools.items()},
        "router": scenario.cluster.router.name,
        "num_kv_blocks": replicas[0].kv.num_blocks,
        "kv_block_size": replicas[0].kv.block_size,
        "horizon_s": scenario.horizon_s,
        "end_s": end_s,
        "complete": True,
    }
    beyond = {pool: note for pool, cfg in pools.items()
              if (note := blocks_beyond_memory(cfg)) is not None}
    if beyond:  # only then: summaries of runs within memory stay as they were
        summary["run"]["blocks_beyond_memory"] = beyond
    if scenario.clients is not None:  # likewise: a closed loop says so
        summary["run"]["clients"] = scenario.clients.model_dump()
    if note := priorities_ignored(scenario):  # likewise
        summary["run"]["priorities_ignored"] = note
    precisions = [_precision(cfg) for cfg in pools.values()]
    if any(precisions):  # only then, likewise: "fp8 weights", "fp8 KV", both (per pool)
        summary["run"]["precision"] = "/".join(
            dict.fromkeys(p or "model dtype" for p in precisions))
    if device := latency.get("device_name"):  # latencies measured on a machine (a profile)
        summary["run"]["latency_measured_on"] = device
        other = sorted({cfg.gpu_name for cfg in pools.values()
                        if not measured_on(cfg.gpu_name, device)})
        if other:  # e.g. a CPU profile run on the default h100-sxm
            summary["run"]["latency_device_note"] = (
                f"latencies measured on {device}, not on {'/'.join(other)}; GPU count, KV "
                f"capacity and cost are those of {'/'.join(other)} (replica.gpu)")
    summary["cost"] = cost_stats(summary, request_cols, pools, replicas)
    summary["latency_model"] = {**latency, "calibration": calibration_facts(pools)}
    return Results(scenario, request_cols, iteration_cols, frames.tokens, summary, gap_cols)
