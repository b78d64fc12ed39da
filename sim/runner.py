"""Run a scenario end to end: load the workload, build the cluster, simulate, collect, write."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from sim.cluster import Cluster
from sim.config import ReplicaConfig, Scenario, load_scenario, scenario_yaml
from sim.engine import Progress
from sim.metrics import pool_stats, replica_stats, summarize, transfer_stats
from sim.request import Request
from sim.results import iteration_frame, request_frame, token_frame, token_times
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


def pool_configs(scenario: Scenario) -> dict[str, ReplicaConfig]:
    """Each pool's replica configuration: one colocated pool, or prefill and decode."""
    cluster = scenario.cluster
    if cluster.prefill is not None and cluster.decode is not None:
        return {"prefill": cluster.prefill.replica, "decode": cluster.decode.replica}
    return {"colocated": scenario.replica}


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

    cluster = Cluster(scenario, fast_forward=fast_forward)
    cluster.run(requests, on_progress)

    logs = [replica.log for replica in cluster.replicas]
    owner, times = token_times(requests, logs)
    request_df, gaps = request_frame(requests, owner, times)
    iteration_df = iteration_frame(logs, [r.pool for r in cluster.replicas])
    summary = summarize(request_df, iteration_df, gaps, scenario.slo)
    summary["requests"]["arrived_after_horizon"] = len(late)
    capacity = {r.replica_id: r.state.kv.num_blocks for r in cluster.replicas}
    summary["replicas"] = replica_stats(iteration_df, capacity, summary["throughput"]["span_s"])
    for stats, replica in zip(summary["replicas"], cluster.replicas, strict=True):
        # Zero when every request is done: prefill blocks freed after each transfer, decode
        # blocks at completion.
        stats["kv_blocks_in_use_at_end"] = replica.state.kv.num_used_blocks
    summary["pools"] = pool_stats(summary["replicas"])
    if cluster.decode:
        summary["transfer"] = transfer_stats(request_df)
    pools = pool_configs(scenario)
    first = cluster.replicas[0]
    summary["run"] = {
        "scenario": scenario.name,
        "seed": scenario.seed,
        "model": next(iter(pools.values())).model,
        "gpu": "/".join(cfg.gpu for cfg in pools.values()),
        "scheduler": "/".join(cfg.scheduler.name for cfg in pools.values()),
        "latency": "/".join(cfg.latency.kind for cfg in pools.values()),
        "pools": {pool: sum(r.pool == pool for r in cluster.replicas) for pool in pools},
        "router": scenario.cluster.router.name,
        "num_kv_blocks": first.state.kv.num_blocks,
        "kv_block_size": first.state.kv.block_size,
        "horizon_s": horizon_s,
    }
    summary["latency_model"] = first.latency.describe()
    tokens = token_frame(requests, owner, times) if scenario.record_token_times else None
    results = Results(scenario, request_df, iteration_df, tokens, summary)
    if out_dir is not None:
        results.write(out_dir)
    return results
