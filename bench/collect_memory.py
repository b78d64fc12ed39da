"""Memory and time of turning a finished run into results (`sim.runner.collect`, issue 14).

Generated requests (default 100,000) on 16 colocated chunked-prefill replicas (Llama-3.1-8B on
H100-SXM, 512-token budget, roofline latency, least_kv_load routing), Poisson arrivals at
`--qps-per-replica` (default 14 req/s) per replica. Lengths: drawn with replacement from the
Azure 2023 conversation trace's (prompt, output) pairs (its Vidur-format copy,
../shared/traces/vidur/splitwise_conv.csv, as bench/cluster_scaling.py), or, without that file
or with --uniform, uniform 100-2000 prompt and 10-400 output tokens.

Each case runs in its own child process and prints: wall seconds of the simulation and of
`collect`; RSS when the simulation is done (current and peak so far); peak RSS of the child
after `collect` (getrusage ru_maxrss); output tokens and iterations; and the P99 TBT, so that
two versions can be compared on the same numbers. The code measured is whatever `import sim`
finds: run with PYTHONPATH=<another checkout> (from outside the repository) to measure it.

    python bench/collect_memory.py [--num-requests 100000 1000000] [--tokens]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONV_LENGTHS = (ROOT / ".." / "shared" / "traces" / "vidur" / "splitwise_conv.csv").resolve()
REPLICA = {"model": "llama-3.1-8b", "gpu": "h100-sxm", "latency": {"kind": "roofline"},
           "scheduler": {"name": "chunked_prefill", "token_budget": 512}}
UNIFORM = {"prompt": {"dist": "uniform", "low": 100, "high": 2000},
           "output": {"dist": "uniform", "low": 10, "high": 400}}


def spec(num_requests: int, replicas: int, qps_per_replica: float, lengths: Path | None,
         tokens: bool) -> dict[str, Any]:
    return {"name": f"collect_{num_requests}_{replicas}", "seed": 0,
            "workload": {"format": "synthetic", "num_requests": num_requests,
                         "arrivals": {"process": "poisson", "qps": qps_per_replica * replicas},
                         "lengths": {"file": str(lengths)} if lengths else UNIFORM},
            "replica": REPLICA, "record_token_times": tokens,
            "cluster": {"replicas": replicas, "router": {"name": "least_kv_load"}}}


def rss_now_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(text: str) -> None:
    """One case in this process; one JSON line of numbers on stdout."""
    import resource

    import sim
    from sim.config.scenario import parse_scenario
    from sim.engine.cluster import Cluster
    from sim.runner import (
        ReplicaRecord,
        collect,
        make_requests,
        mark_after_horizon,
    )
    from sim.workloads.load import load_workload

    def peak_mb() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    scenario = parse_scenario(json.loads(text), "bench/collect_memory.py")
    t0 = time.perf_counter()
    requests = make_requests(load_workload(scenario))
    cluster = Cluster(scenario)
    cluster.run(mark_after_horizon(requests, scenario.horizon_s))
    records = [ReplicaRecord(r.pool, r.log, r.state.kv) for r in cluster.replicas]
    sim_wall = time.perf_counter() - t0
    rss_after_sim, peak_after_sim = rss_now_mb(), peak_mb()
    t0 = time.perf_counter()
    res = collect(scenario, requests, records, cluster.replicas[0].latency.describe())
    collect_wall = time.perf_counter() - t0
    s = res.summary
    print(json.dumps({
        "code": str(Path(sim.__file__).parent), "sim_wall_s": sim_wall,
        "collect_wall_s": collect_wall, "rss_after_sim_mb": rss_after_sim,
        "peak_after_sim_mb": peak_after_sim, "peak_mb": peak_mb(),
        "tokens": int(res.requests["num_generated_tokens"].sum()),
        "iterations": s["num_iterations"], "finished": s["requests"]["finished"],
        "verdict": s["overload"]["verdict"], "tbt_p99_s": s["tbt_s"]["p99"],
        "tbt_mean_s": s["tbt_s"]["mean"], "tbt_count": s["tbt_s"]["count"]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--num-requests", type=int, nargs="+", default=[100_000])
    parser.add_argument("--replicas", type=int, default=16)
    parser.add_argument("--qps-per-replica", type=float, default=14.0)
    parser.add_argument("--uniform", action="store_true",
                        help="uniform 100-2000 / 10-400 lengths instead of the trace's")
    parser.add_argument("--tokens", action="store_true", help="record_token_times: true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child)
        return
    lengths = None if args.uniform or not CONV_LENGTHS.exists() else CONV_LENGTHS
    print(f"lengths: {lengths or 'uniform 100-2000 / 10-400'}; {args.replicas} replicas at "
          f"{args.qps_per_replica:g} req/s each; record_token_times={args.tokens}", flush=True)
    print(f"{'requests':>10} {'tokens':>12} {'iterations':>11} {'sim s':>7} {'collect s':>9} "
          f"{'RSS after sim MB':>16} {'peak in sim MB':>14} {'peak MB':>8} {'TBT P99 ms':>10}",
          flush=True)
    for n in args.num_requests:
        case = spec(n, args.replicas, args.qps_per_replica, lengths, args.tokens)
        proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(case)],
                              capture_output=True, text=True, env=os.environ.copy())
        if proc.returncode != 0:
            raise SystemExit(f"{n} requests failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{n:>10,} {r['tokens']:>12,} {r['iterations']:>11,} {r['sim_wall_s']:>7.1f} "
              f"{r['collect_wall_s']:>9.2f} {r['rss_after_sim_mb']:>16.0f} "
              f"{r['peak_after_sim_mb']:>14.0f} {r['peak_mb']:>8.0f} "
              f"{r['tbt_p99_s'] * 1e3:>10.3f}", flush=True)
        print(f"  {json.dumps(r)}", flush=True)


if __name__ == "__main__":
    main()
