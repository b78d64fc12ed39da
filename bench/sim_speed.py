"""Simulator speed: replay the whole Azure 2023 conversation trace (19,366 requests, about an
hour) through each scheduler on one Llama-3-8B replica on an H100 (roofline latency).

Prints wall seconds, simulated requests and output tokens per wall second, iterations per second,
peak RSS and P99 TBT per scheduler. Target: under 5 s per scheduler on one core.

    python bench/sim_speed.py [--trace PATH] [--rate-scale X]
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from sim import Scenario, run_scenario
from sim.config import parse_scenario

DEFAULT_TRACE = (Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" /
                 "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv").resolve()

SCHEDULERS = {
    "prefill_first": {"name": "prefill_first"},
    "chunked_prefill": {"name": "chunked_prefill", "token_budget": 512},
}


def scenario(trace: Path, scheduler: dict, rate_scale: float) -> Scenario:
    return parse_scenario({
        "name": f"bench-{scheduler['name']}",
        "workload": {"format": "azure", "path": str(trace), "rate_scale": rate_scale},
        "replica": {"model": "llama-3-8b", "gpu": "h100-sxm", "scheduler": scheduler,
                    "latency": {"kind": "roofline"}},
    }, "bench/sim_speed.py")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--rate-scale", type=float, default=1.0)
    args = parser.parse_args()

    table = Table(title=f"{args.trace.name} x{args.rate_scale}, llama-3-8b on h100-sxm, roofline")
    for col in ("scheduler", "wall s", "requests", "req/wall s", "out tok/wall s", "iterations",
                "iter/wall s", "peak RSS MB", "P99 TBT ms", "P99 TTFT s"):
        table.add_column(col, justify="right")
    for name, sched in SCHEDULERS.items():
        sc = scenario(args.trace, sched, args.rate_scale)
        t0 = time.perf_counter()
        res = run_scenario(sc)
        wall = time.perf_counter() - t0
        s = res.summary
        tokens = int(res.requests["num_generated_tokens"].sum())
        table.add_row(name, f"{wall:.2f}", str(s["requests"]["finished"]),
                      f"{s['requests']['finished'] / wall:,.0f}", f"{tokens / wall:,.0f}",
                      f"{s['num_iterations']:,}", f"{s['num_iterations'] / wall:,.0f}",
                      f"{peak_rss_mb():.0f}", f"{s['tbt_s']['p99'] * 1e3:.1f}",
                      f"{s['ttft_s']['p99']:.3f}")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
