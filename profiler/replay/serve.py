"""`servesim replay`: serve a scenario's requests for real, in real time, on one replica.

The wall-clock twin of `sim.engine.replica.Replica.run`: the same scheduler class and config, the
same `ReplicaState` and KV accounting, and the same results (`sim.runner.collect`); only time comes
from the clock and each plan is executed by the profiler's decoder (`Executor`) instead of being
priced by a latency model.

Timing. An iteration starts when the loop asks the scheduler for a plan and ends when the next
one could start, after its commit; so iterations tile the busy time and everything the loop does
is in some iteration: `forward_s` (the forward pass) plus `host_s` (scheduling, input
preparation, sampling, commit, progress). Arrivals are released at the loop's planning points,
as in the simulator, where they wait for the iteration in progress. When idle, the loop sleeps
until the next arrival and plans as of that arrival: the time it takes to wake is part of that
iteration's host time (and recorded as `wake_s`). With these durations the simulator
(`latency: {kind: recorded}`) sees exactly the same instants, so it must reproduce the plans.
"""

from __future__ import annotations

import gc
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from profiler.measure.model import does_not_fit, unbuildable
from profiler.replay.executor import Executor
from sim.config.errors import InputError
from sim.config.scenario import Scenario
from sim.core.request import Request, Status
from sim.core.state import ReplicaState
from sim.engine.cluster import kv_cache_for, make_scheduler
from sim.engine.iteration_log import IterationLog
from sim.hardware.gpus import measured_on
from sim.latency.base import BatchShape
from sim.results.interrupts import on_sigint
from sim.results.metrics.summary import distribution
from sim.results.outdir import check_out_dir
from sim.results.run_dir import Results
from sim.runner import (
    ReplicaRecord,
    collect,
    make_requests,
    mark_after_horizon,
)
from sim.schedulers import Scheduler
from sim.studies.progress import ProgressReport
from sim.workloads.load import load_workload

# Columns replay adds to iterations.parquet: the full shape of each iteration (the simulator's
# log keeps only token counts), the forward pass, and what it measured around it.
SHAPE_COLUMNS = ("num_prefill_seqs", "num_sampled_tokens", "prefill_attn_pairs",
                 "prefill_kv_tokens", "decode_kv_tokens")
MEASURED_COLUMNS = ("forward_s", "wake_s", "num_scattered_seqs")
SPIN_S = 0.002  # sleep until this close to an arrival, then spin: wake-up within microseconds
REPORT_EVERY_S = 0.5


def check_replayable(scenario: Scenario) -> None:
    """One colocated replica: what `replay` serves."""
    cluster = scenario.cluster
    if cluster.disaggregated:
        raise InputError(scenario.source, "cluster.prefill", "disaggregated",
                         "replay serves one colocated replica")
    if cluster.replicas != 1:
        raise InputError(scenario.source, "cluster.replicas", cluster.replicas,
                         "replay serves one colocated replica")
    if scenario.replica.parallelism.num_gpus > 1:
        raise InputError(scenario.source, "replica.parallelism",
                         scenario.replica.parallelism.model_dump(),
                         "replay runs the model on one device")
    if why := unbuildable(scenario.replica.model_shape):
        raise InputError(scenario.source, "replica.model", str(scenario.replica.model), why)
    if scenario.replica.kv_cache.dtype != "auto":
        raise InputError(scenario.source, "replica.kv_cache.dtype",
                         scenario.replica.kv_cache.dtype,
                         "replay keeps the KV cache in the model's dtype")
    if scenario.replica.quantization != "none":
        raise InputError(scenario.source, "replica.quantization", scenario.replica.quantization,
                         "replay runs the model's weights in the model's dtype")
    if scenario.replica.prefix_caching:
        # The executor's block tables are per request: shared prefix blocks are not built.
        raise InputError(scenario.source, "replica.prefix_caching", True,
                         "replay does not share KV between requests yet")
    if scenario.clients is not None:
        raise InputError(scenario.source, "clients", scenario.clients.model_dump(),
                         "replay sends every request at its arrival time: closed-loop clients "
                         "are simulated only; remove them")
    if scenario.workload.timeout_s is not None:
        raise InputError(scenario.source, "workload.timeout_s", scenario.workload.timeout_s,
                         "replay does not abort requests on a client timeout yet: remove it")


# A replay serves its arrivals on the wall clock: longer than a day is not what anyone waits
# for (a trace's years between arrivals once waited in real time until killed).
MAX_REPLAY_SPAN_S = 24 * 3600.0


def check_span(scenario: Scenario, requests: list[Request]) -> None:
    """Refuse, before any set-up, arrivals a replay would wait more than a day of wall time
    for (those after the horizon are never served)."""
    horizon = scenario.horizon_s if scenario.horizon_s is not None else math.inf
    last_s = max((r.arrival_s for r in requests if r.arrival_s < horizon), default=0.0)
    if last_s > MAX_REPLAY_SPAN_S:
        raise InputError(scenario.source, "workload", scenario.workload.format,
                         f"its arrivals span {last_s:.3g} s ({last_s / 86400:.3g} days), "
                         "which a replay serves on the wall clock: at most a day; cut it with "
                         "horizon_s, workload.end_s or workload.num_requests, or raise "
                         "workload.rate_scale")


class ReplayLoop:
    """Schedule, execute, commit, on the wall clock, until every request is done."""

    def __init__(self, scheduler: Scheduler, state: ReplicaState, executor: Executor,
                 arrivals: list[Request], horizon_s: float | None,
                 progress: ProgressReport | None = None) -> None:
        self.scheduler = scheduler
        self.state = state
        self.executor = executor
        self.pending = arrivals  # in arrival order
        self.horizon_s = horizon_s
        self.progress = progress
        self.log = IterationLog()
        self.measured: dict[str, list[float]] = {name: [] for name in (*SHAPE_COLUMNS,
                                                                         *MEASURED_COLUMNS)}
        self.next = 0  # first request not yet released
        self.num_done = 0
        self.wake_s = 0.0
        self.stop_requested = False
        self._t0 = 0.0
        self._last_report = -np.inf

    def clock(self) -> float:
        return time.perf_counter() - self._t0

    def run(self) -> float:
        """Serve until done, the horizon, or a stop request; return the time it stopped."""
        self._t0 = time.perf_counter()
        now = 0.0  # the first planning point is t=0, the first arrival
        while not self.stop_requested:
            if self.horizon_s is not None and now >= self.horizon_s:
                break
            self._release(now)
            if not self.state.running and not self.state.waiting:
                if self.next >= len(self.pending):
                    break
                now = self._idle_until(self.pending[self.next].arrival_s)
                continue
            now = self._iteration(now)
        return now

    def _release(self, now: float) -> None:
        """Arrivals up to `now` join the queue (or are rejected, as `Replica.submit` does)."""
        state = self.state
        while self.next < len(self.pending) and self.pending[self.next].arrival_s <= now:
            req = self.pending[self.next]
            self.next += 1
            req.replica_id = req.prefill_replica_id = 0
            reason = self.scheduler.reject_reason(req, state.kv, state.num_kv_tokens_needed(req))
            if reason is not None:
                req.status, req.reason = Status.REJECTED, reason
                state.requests[req.request_id] = req
                self.num_done += 1
            else:
                state.add(req)

    def _idle_until(self, at_s: float) -> float:
        """Nothing to do: wait for the arrival at `at_s`; the next plan is made as of then."""
        while not self.stop_requested:
            left = at_s - self.clock()
            if left <= 0:
                break
            if left > SPIN_S:
                time.sleep(min(left - SPIN_S, 0.05))
                self.report(self.clock())
        self.wake_s = max(0.0, self.clock() - at_s)
        return at_s

    def _iteration(self, start_s: float) -> float:
        state = self.state
        plan = self.scheduler.schedule(state, start_s)
        if not plan:
            raise RuntimeError("requests queued, none can run")
        shape = BatchShape.from_plan(plan, state.requests)
        num_used_blocks, num_waiting = state.kv.num_used_blocks, len(state.waiting)
        forward_s = self.executor.run(plan, state.requests)
        t = self.clock()
        if self.horizon_s is not None and t >= self.horizon_s:
            return t  # ends after the horizon: not committed, as in the simulator
        since = self.log.last_decode_iteration  # before this one is logged
        index = self.log.append(start_s, t - start_s, shape.num_prefill_tokens,
                                shape.num_decode_tokens, plan.num_seqs, num_used_blocks,
                                len(plan.preempted_ids), num_waiting)
        done = state.commit(plan, index, start_s, t, since)
        self.executor.release(done)
        self.num_done += len(done)
        self._record(shape, forward_s)
        self.report(t)
        end_s = self.clock()
        # The iteration ends now, after its commit: patch what was written with `t`.
        self.log.set_duration(index, end_s - start_s)
        for req in done:
            req.finish_s = end_s
        return end_s

    def _record(self, shape: BatchShape, forward_s: float) -> None:
        m = self.measured
        for name in SHAPE_COLUMNS:
            m[name].append(getattr(shape, name))
        m["forward_s"].append(forward_s)
        m["wake_s"].append(self.wake_s)
        m["num_scattered_seqs"].append(self.executor.num_scattered)
        self.wake_s = 0.0

    def report(self, now: float, final: bool = False) -> None:
        """Requests done, and how far service lags behind arrivals (the oldest queued wait)."""
        if self.progress is None or (now - self._last_report < REPORT_EVERY_S and not final):
            return
        self._last_report = now
        waiting = self.state.waiting
        lag = now - min(r.arrival_s for r in waiting) if waiting else 0.0
        self.progress.update(self.num_done, len(self.pending),
                             extra=f"queue {len(waiting)}, lag {lag:.2f} s")


def replay(scenario: Scenario, *, device: str = "cpu", threads: int | None = None,
           attention: str | None = None, out_dir: Path | None = None,
           progress: ProgressReport | None = None, command: str = "") -> Results:
    """Serve `scenario` for real; write its results to `out_dir` (checked first) if given.
    Interrupted (Ctrl-C), it keeps what ran: summary `run.complete` is False and every request
    not done has the reason `interrupted`."""
    from profiler.measure.device import torch_setup
    from profiler.measure.timing import default_attention, environment

    check_replayable(scenario)
    if out_dir is not None:
        check_out_dir(out_dir)
    workload = load_workload(scenario)
    if workload.sessions is not None:
        raise InputError(scenario.source, "workload.wait_for_answer", True,
                         "replay sends every request at its arrival time: turns that wait for "
                         "answers are simulated only; set it to false")
    requests = make_requests(workload, [c.priority for c in scenario.workload.classes or []],
                             ignore_eos=scenario.workload.ignore_eos)
    check_span(scenario, requests)
    torch, dtype = torch_setup(device, threads)
    attention = attention or default_attention(device)
    cfg = scenario.replica
    model = cfg.model_shape
    scheduler = make_scheduler(cfg)
    check_fits(scenario, device, dtype)
    kv = kv_cache_for(cfg, model, "replica", scenario.source, scheduler)
    arrivals = mark_after_horizon(requests, scenario.horizon_s)
    state = ReplicaState(kv, by_priority=scheduler.by_priority)
    executor = Executor(model, kv, device=device, dtype=dtype, seed=scenario.seed,
                        attention=attention)
    executor.warm_up(largest_iteration(scenario), cfg.scheduler.max_num_seqs)
    loop = ReplayLoop(scheduler, state, executor, arrivals, scenario.horizon_s, progress)
    if progress is not None:
        # The report's own title first: validate names the scheduler, load and replay there
        # (the scenario's name is the same for every one of its replays).
        progress.note(f"{progress.description}: {len(arrivals)} requests of {scenario.name} "
                      f"on {device} ({torch.get_num_threads()} thread(s)); Ctrl-C stops and "
                      "keeps what ran")
    loadavg_start = os.getloadavg()[0]
    gc.collect()
    gc.freeze()  # the setup's objects: later collections scan only what the loop creates
    try:
        # Ctrl-C asks the loop to stop between iterations (never inside a commit).
        with on_sigint(lambda: setattr(loop, "stop_requested", True)):
            stop_s = loop.run()
    finally:
        gc.unfreeze()
    loop.report(stop_s, final=True)
    interrupted = loop.stop_requested
    if interrupted:
        _mark_interrupted(requests, stop_s)
    else:
        state.check()
    env = environment(device, dtype, attention)
    results = collect(scenario, requests, [ReplicaRecord("colocated", loop.log, kv)],
                      {"kind": "replay", "device": device, **env},
                      end_s=stop_s if interrupted else None)
    env["loadavg_1m"] = [loadavg_start, os.getloadavg()[0]]  # others sharing the machine
    _add_measurements(results, loop, env, command, interrupted, stop_s)
    if out_dir is not None:
        results.write(out_dir)
    return results


def largest_iteration(scenario: Scenario) -> int:
    sched = scenario.replica.scheduler
    for name in ("token_budget", "max_num_batched_tokens"):
        value = getattr(sched, name, None)
        if isinstance(value, int):
            return value
    return 512


def check_fits(scenario: Scenario, device: str, dtype: Any) -> None:
    """The model and its KV pool are allocated for real: refuse what cannot fit in memory."""
    cfg = scenario.replica
    kv = kv_cache_for(cfg, cfg.model_shape, "replica", scenario.source, make_scheduler(cfg))
    problem = does_not_fit(cfg.model_shape, kv.num_blocks * kv.block_size, device, dtype,
                           block_size=kv.block_size)
    if problem is None:
        return
    why, pool_is_bulk = problem
    if pool_is_bulk:
        raise InputError(scenario.source, "replica.kv_cache.num_blocks", kv.num_blocks,
                         f"{why}: give fewer blocks")
    raise InputError(scenario.source, "replica.model", str(cfg.model),
                     f"{why}: replay a smaller model here")


def _mark_interrupted(requests: list[Request], stop_s: float) -> None:
    for req in requests:
        if req.status in (Status.FINISHED, Status.REJECTED) or req.reason:
            continue  # done, or already has its reason (after the horizon)
        if req.replica_id < 0:
            req.reason = f"after_stop: arrives at {req.arrival_s:.3f} s, after the replay stopped"
        else:
            req.reason = f"interrupted: {req.status.value} at {stop_s:.3f} s"


def _add_measurements(results: Results, loop: ReplayLoop, env: dict[str, Any], command: str,
                      interrupted: bool, stop_s: float) -> None:
    """Per iteration: the full shape, forward and host seconds; in the summary, what replay
    measured and where."""
    measured = {name: np.asarray(values, dtype=np.float64 if name.endswith("_s") else np.int64)
                for name, values in loop.measured.items()}
    duration = np.asarray(results.tables["iterations"]["duration_s"])
    measured["host_s"] = duration - measured["forward_s"]
    results.add_columns("iterations", measured)
    summary = results.summary
    summary["run"]["latency"] = "replay"
    scenario_gpu = summary["run"]["gpu"]
    summary["run"]["gpu"] = env["device_name"]  # what served it, not the scenario's `gpu`
    summary["run"].pop("latency_device_note", None)  # the run's GPU is the measuring device
    if not all(measured_on(gpu, env["device_name"]) for gpu in scenario_gpu.split("/")):
        # The scenario's price is not this device's (a CPU has none in the GPU table).
        summary["cost"].update(usd_per_hour=None, usd_per_million_output_tokens=None,
                               usd_per_million_tokens=None, usd_per_request=None)
        summary["run"]["unpriced"] = (f"served on {env['device_name']}, not on "
                                      f"{scenario_gpu}: no price for it")
    summary["run"]["complete"] = not interrupted
    busy_s = float(duration.sum())
    wakes = measured["wake_s"]
    summary["replay"] = {
        **env,
        "command": command,
        "forward_s": distribution(measured["forward_s"]),
        "host_s": distribution(measured["host_s"]),
        "host_share": float(measured["host_s"].sum()) / busy_s if busy_s > 0 else None,
        "wake_s": distribution(wakes[wakes > 0]),
        "num_scattered_seq_iterations": int(measured["num_scattered_seqs"].sum()),
        "interrupted_at_s": stop_s if interrupted else None,
    }
