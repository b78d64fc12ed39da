"""Cluster-scale runs (issue 14): cost against requests and replicas, with peak memory.

(a) Generated requests on colocated chunked-prefill replicas (Llama-3.1-8B on H100-SXM,
    512-token budget, roofline latency, least_kv_load routing): Poisson arrivals at
    `--qps-per-replica` (default 14 req/s) times the number of replicas, lengths drawn with
    replacement from the Azure 2023 conversation trace's (prompt, output) pairs (its
    Vidur-format copy, ../shared/traces/vidur/splitwise_conv.csv: mean 1155 / 211 tokens). One
    such replica holds up to about 17 req/s of these (2026-11, 10,000 requests: stable at 16,
    overloaded at 20), so 14 keeps every replica busy (about 80%) and the cluster stable.
    Target: 1,000,000 requests on 16 replicas in <= 60 s within 2 GB peak RSS.
(b) The whole Azure 2023 conversation trace (19,366 requests) replayed at 64x its rate on 64
    replicas, least_kv_load routing (the trace is read in place, never copied). Target: <= 60 s.

Each case runs in its own process, pinned to one core (`taskset -c 0` where it exists): wall
of the whole process and of `run_scenario` alone, peak RSS of the process (getrusage), SimPy
events scheduled, iterations. A case that runs past `--timeout` or above `--max-rss-gb` is
stopped (and larger sizes with the same replicas are skipped).

    python bench/cluster_scaling.py --num-requests 10000 100000 1000000 --replicas 16
    python bench/cluster_scaling.py --num-requests 100000 --replicas 4 16 64 --skip-azure
    python bench/cluster_scaling.py --azure-only
    python bench/cluster_scaling.py --num-requests 100000 --scheduler vllm_v1 --skip-azure
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
# This checkout's sim in each case's process, not the installed one (a venv's editable install
# points at one checkout: timing another worktree against it would time the same code twice).
sys.path.insert(0, str(ROOT))
TRACES = (ROOT / ".." / "shared" / "traces").resolve()
AZURE_CONV = TRACES / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
CONV_LENGTHS = TRACES / "vidur" / "splitwise_conv.csv"
REPLICA = {"model": "llama-3.1-8b", "gpu": "h100-sxm", "latency": {"kind": "roofline"},
           "scheduler": {"name": "chunked_prefill", "token_budget": 512}}
ROUTER = {"name": "least_kv_load"}
console = Console(width=170)


def generated(num_requests: int, replicas: int, qps_per_replica: float,
              lengths: Path, scheduler: dict[str, Any] | None = None) -> dict[str, Any]:
    """Case (a)'s scenario; `scheduler`: the replicas' policy, chunked prefill if None."""
    return {"name": f"gen_{num_requests}_{replicas}", "seed": 0,
            "workload": {"format": "synthetic", "num_requests": num_requests,
                         "arrivals": {"process": "poisson", "qps": qps_per_replica * replicas},
                         "lengths": {"file": str(lengths)}},
            "replica": REPLICA if scheduler is None else {**REPLICA, "scheduler": scheduler},
            "cluster": {"replicas": replicas, "router": ROUTER} if replicas > 1 else {}}


def azure(trace: Path, replicas: int, rate_scale: float) -> dict[str, Any]:
    return {"name": f"azure_conv_{replicas}x", "seed": 0,
            "workload": {"format": "azure", "path": str(trace), "rate_scale": rate_scale},
            "replica": REPLICA, "cluster": {"replicas": replicas, "router": ROUTER}}


def child(spec: str) -> None:
    """Run one scenario (a JSON mapping) in this process; print one JSON line of numbers."""
    import resource

    import sim.runner as runner
    from sim.config.scenario import parse_scenario
    from sim.engine.cluster import Cluster

    events: list[int] = []

    class Recording(Cluster):
        """Reads the SimPy event counter after the run, keeping nothing of the cluster (which
        holds every request: `run_scenario` frees them before its peak)."""

        def run(self, *args: Any, **kwargs: Any) -> None:
            super().run(*args, **kwargs)
            eid = getattr(self.env, "_eid", None)
            if eid is not None:
                events.append(next(eid))

    runner.Cluster = Recording  # type: ignore[misc]
    scenario = parse_scenario(json.loads(spec), "bench/cluster_scaling.py")
    t0 = time.perf_counter()
    res = runner.run_scenario(scenario)
    wall = time.perf_counter() - t0
    s = res.summary
    print(json.dumps({
        "sim_wall_s": wall, "events": events[0] if events else None,
        "iterations": s["num_iterations"], "finished": s["requests"]["finished"],
        "total": s["requests"]["total"], "verdict": s["overload"]["verdict"],
        "ttft_p99_s": s["ttft_s"]["p99"], "tbt_p99_s": s["tbt_s"]["p99"],
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def run_case(spec: dict[str, Any], pin: list[str], timeout_s: float,
             max_rss_mb: float) -> dict[str, Any]:
    """One case in a child process, watched: stopped past the time or memory limit."""
    cmd = [*pin, sys.executable, __file__, "--child", json.dumps(spec)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stopped = ""
    peak = 0.0
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        peak = max(peak, rss_mb(proc.pid))
        elapsed = time.perf_counter() - t0
        if not stopped and (elapsed > timeout_s or peak > max_rss_mb):
            stopped = (f"stopped after {elapsed:.0f} s" if elapsed > timeout_s
                       else f"stopped at {peak:.0f} MB RSS")
            os.kill(proc.pid, signal.SIGKILL)
        time.sleep(0.2)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    out, err = proc.communicate()
    if stopped:
        return {"stopped": stopped, "wall_s": wall, "rss_mb": peak}
    if proc.returncode != 0:
        raise SystemExit(f"case {spec['name']} failed ({proc.returncode}):\n{err[-3000:]}")
    record = json.loads(out.strip().splitlines()[-1])
    record.update(wall_s=wall, cpu_s=usage.ru_utime + usage.ru_stime,
                  rss_mb=usage.ru_maxrss / 1024)
    return record


def add_row(table: Table, label: str, requests: int, replicas: int, r: dict[str, Any],
            target: str) -> None:
    if "stopped" in r:
        table.add_row(label, f"{requests:,}", str(replicas), f"{r['wall_s']:.1f}", "-", "-",
                      "-", "-", "-", f"{r['rss_mb']:.0f}", f"[red]{r['stopped']}[/]", "-", "-",
                      target)
        return
    events = r.get("events")
    table.add_row(
        label, f"{requests:,}", str(replicas), f"{r['wall_s']:.1f}", f"{r['sim_wall_s']:.1f}",
        f"{r['wall_s'] / requests * 1e6:.0f}", f"{events:,}" if events else "-",
        f"{r['sim_wall_s'] / events * 1e6:.1f}" if events else "-", f"{r['iterations']:,}",
        f"{r['rss_mb']:.0f}", f"{r['verdict']}, {r['finished'] / r['total']:.0%}",
        f"{r['ttft_p99_s']:.2f}", f"{r['tbt_p99_s'] * 1e3:.1f}", target)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--num-requests", type=int, nargs="+", default=[10_000, 100_000,
                                                                        1_000_000])
    parser.add_argument("--replicas", type=int, nargs="+", default=[16])
    parser.add_argument("--qps-per-replica", type=float, default=14.0)
    parser.add_argument("--scheduler", default="chunked_prefill",
                        help="the generated cases' policy (its defaults; chunked_prefill: a "
                             "512-token budget)")
    parser.add_argument("--lengths", type=Path, default=CONV_LENGTHS,
                        help="CSV with num_prefill_tokens,num_decode_tokens")
    parser.add_argument("--trace", type=Path, default=AZURE_CONV)
    parser.add_argument("--azure-replicas", type=int, default=64)
    parser.add_argument("--rate-scale", type=float, default=64.0)
    parser.add_argument("--skip-azure", action="store_true")
    parser.add_argument("--azure-only", action="store_true")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per case")
    parser.add_argument("--max-rss-gb", type=float, default=8.0, help="per case")
    parser.add_argument("--no-taskset", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child)
        return
    pin = [] if args.no_taskset or shutil.which("taskset") is None else ["taskset", "-c", "0"]
    limit_mb = args.max_rss_gb * 1024

    policy = "chunked prefill 512" if args.scheduler == "chunked_prefill" else args.scheduler
    table = Table(title=f"cluster scaling: llama-3.1-8b on h100-sxm, {policy} (generated), "
                        f"least_kv_load, roofline; one process per case, "
                        f"{'one core (taskset -c 0)' if pin else 'unpinned'}")
    for col in ("case", "requests", "replicas", "wall s", "sim s", "ms/1k req", "events",
                "us/event", "iterations", "RSS MB", "verdict, done", "TTFT P99 s",
                "TBT P99 ms", "target"):
        table.add_column(col, justify="right", overflow="fold")
    if not args.azure_only:
        for replicas in args.replicas:
            for n in sorted(args.num_requests):
                spec = generated(n, replicas, args.qps_per_replica, args.lengths,
                                 None if args.scheduler == "chunked_prefill"
                                 else {"name": args.scheduler})
                console.print(f"running {n:,} generated requests on {replicas} replicas at "
                              f"{args.qps_per_replica * replicas:g} req/s ...", highlight=False)
                r = run_case(spec, pin, args.timeout, limit_mb)
                console.print(f"  {json.dumps(r)}", highlight=False)
                target = "60 s, 2 GB" if (n, replicas) == (1_000_000, 16) else ""
                add_row(table, "generated", n, replicas, r, target)
                if "stopped" in r:
                    break
    if not args.skip_azure:
        spec = azure(args.trace, args.azure_replicas, args.rate_scale)
        console.print(f"running the Azure conv trace at {args.rate_scale:g}x on "
                      f"{args.azure_replicas} replicas ...", highlight=False)
        r = run_case(spec, pin, args.timeout, limit_mb)
        console.print(f"  {json.dumps(r)}", highlight=False)
        add_row(table, f"azure conv x{args.rate_scale:g}", r.get("total", 19366),
                args.azure_replicas, r, "60 s")
    table.caption = ("wall s: whole process; sim s: run_scenario alone; ms/1k req: whole-"
                     "process wall per 1,000 requests; events: SimPy events scheduled; us/event: "
                     "sim s per event; RSS: peak of the process; done: share of requests "
                     "finished; target: at most")
    console.print(table)


if __name__ == "__main__":
    main()
