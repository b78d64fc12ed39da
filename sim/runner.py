"""Run a scenario end to end: load the workload, build the replica, simulate, collect, write."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import simpy

from sim.config import ReplicaConfig, Scenario, load_scenario, scenario_yaml
from sim.engine import Progress, Replica, simulate
from sim.errors import InputError
from sim.gpus import GPUS
from sim.kv_cache import KVCacheManager
from sim.latency import LATENCY_MODELS, LatencyModel
from sim.metrics import summarize
from sim.models import MODELS, ModelShape
from sim.request import Request
from sim.results import iteration_frame, request_frame, token_frame, token_times
from sim.schedulers import SCHEDULERS
from sim.state import ReplicaState
from sim.workloads import FORMATS, Workload, select


@dataclass
class Results:
    """What a run produced; `write` puts it next to its resolved scenario."""

    scenario: Scenario
    requests: pd.DataFrame
    iterations: pd.DataFrame
    tokens: pd.DataFrame | None
    summary: dict[str, Any]

    def write(self, out_dir: str | Path) -> Path:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "scenario.yaml").write_text(scenario_yaml(self.scenario))
        self.requests.to_parquet(out / "requests.parquet", index=False)
        self.iterations.to_parquet(out / "iterations.parquet", index=False)
        if self.tokens is not None:
            self.tokens.to_parquet(out / "tokens.parquet", index=False)
        (out / "summary.json").write_text(json.dumps(self.summary, indent=2, sort_keys=True) + "\n")
        return out


def load_workload(scenario: Scenario, base_dir: Path | None = None) -> Workload:
    cfg = scenario.workload
    rng = np.random.default_rng(scenario.seed)
    full = FORMATS.get(cfg.format)().load(cfg, base_dir or Path.cwd(), rng)
    return select(full, cfg)


def kv_cache_for(cfg: ReplicaConfig, model: ModelShape) -> KVCacheManager:
    """The replica's KV cache: the blocks given, or what GPU memory holds after the weights."""
    kv = cfg.kv_cache
    if kv.num_blocks is not None:
        return KVCacheManager(kv.num_blocks, kv.block_size)
    gpu = GPUS.get(cfg.gpu)
    free_bytes = (gpu.memory_bytes * kv.gpu_memory_utilization - model.weight_bytes
                  - kv.activation_reserve_gb * 1e9)
    num_blocks = int(free_bytes // (kv.block_size * model.kv_bytes_per_token))
    if num_blocks <= 0:
        raise InputError(None, "replica.kv_cache", f"{cfg.model} on {cfg.gpu}",
                         f"no room for KV: weights take {model.weight_bytes / 1e9:.1f} GB of "
                         f"{gpu.memory_bytes * kv.gpu_memory_utilization / 1e9:.1f} GB usable")
    return KVCacheManager(num_blocks, kv.block_size)


def latency_model_for(cfg: ReplicaConfig) -> LatencyModel:
    model, gpu = MODELS.get(cfg.model), GPUS.get(cfg.gpu)
    return LATENCY_MODELS.get(cfg.latency.kind)(cfg.latency, model, gpu)


def make_requests(workload: Workload) -> list[Request]:
    hash_ids = workload.hash_ids
    return [
        Request(i, float(t), int(p), int(o), hash_ids[i] if hash_ids is not None else None)
        for i, (t, p, o) in enumerate(zip(workload.arrival_s.tolist(),
                                          workload.num_prompt_tokens.tolist(),
                                          workload.num_output_tokens.tolist(), strict=True))
    ]


def run_scenario(scenario: Scenario | str | Path | None = None, *, seed: int | None = None,
                 out_dir: str | Path | None = None, fast_forward: bool = True,
                 on_progress: Progress | None = None) -> Results:
    """Simulate a scenario (a `Scenario`, a YAML path, or None for the embedded default).

    `seed` overrides the scenario's; `out_dir`, if given, receives the result files.
    `fast_forward=False` steps every iteration (slow; for checking the fast path).
    `on_progress(arrived, total)` is called as requests arrive."""
    if not isinstance(scenario, Scenario):
        scenario = load_scenario(scenario)
    if seed is not None:
        scenario = scenario.model_copy(update={"seed": seed})
    workload = load_workload(scenario)
    requests = make_requests(workload)
    horizon_s = scenario.horizon_s
    late = [r for r in requests if horizon_s is not None and r.arrival_s >= horizon_s]
    if late:
        requests = requests[: len(requests) - len(late)]

    cfg = scenario.replica
    model = MODELS.get(cfg.model)
    env = simpy.Environment()
    scheduler = SCHEDULERS.get(cfg.scheduler.name)(cfg.scheduler)
    state = ReplicaState(kv_cache_for(cfg, model))
    latency = latency_model_for(cfg)
    replica = Replica(env, 0, scheduler, latency, state,
                      horizon_s=horizon_s, fast_forward=fast_forward)
    simulate(env, requests, replica.submit, horizon_s, on_progress)
    state.check()

    owner, times = token_times(requests, [replica.log])
    request_df, gaps = request_frame(requests, owner, times)
    iteration_df = iteration_frame([replica.log])
    summary = summarize(request_df, iteration_df, gaps, scenario.slo)
    summary["requests"]["arrived_after_horizon"] = len(late)
    summary["run"] = {
        "scenario": scenario.name,
        "seed": scenario.seed,
        "model": cfg.model,
        "gpu": cfg.gpu,
        "scheduler": cfg.scheduler.name,
        "latency": cfg.latency.kind,
        "num_kv_blocks": state.kv.num_blocks,
        "kv_block_size": state.kv.block_size,
        "horizon_s": horizon_s,
    }
    summary["latency_model"] = latency.describe()
    tokens = token_frame(requests, owner, times) if scenario.record_token_times else None
    results = Results(scenario, request_df, iteration_df, tokens, summary)
    if out_dir is not None:
        results.write(out_dir)
    return results
