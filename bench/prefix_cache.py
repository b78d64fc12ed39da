"""Prefix caching's cost: the Mooncake conversation trace (first N requests) on one
Llama-3.1-8B H100 replica under `vllm_v1` (synchronous, so the decode fast path applies;
`--scheduler sglang`: SGLang's normal loop and radix cache), caching off and on, at a few
sizes: wall seconds, peak RSS, hit rate and evicted blocks. Caching must stay linear in
blocks: seconds and memory per request about flat as N grows.

Each point runs in a fresh process (peak RSS is per process). Run it from another worktree to
compare commits (`git worktree add /tmp/before <commit>`, then `python bench/prefix_cache.py`
there): it times the checkout it lives in.

    python bench/prefix_cache.py [--sizes 1000 4000 12031] [--blocks 20000] [--scheduler sglang]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACE = (ROOT / ".." / "shared" / "traces" / "mooncake_fast25" / "conversation_trace.jsonl")


def one(num_requests: int, caching: bool, num_blocks: int, scheduler: str) -> dict:
    sys.path.insert(0, str(ROOT))  # this checkout's sim, not the installed one
    from sim import run_scenario
    from sim.config.scenario import parse_scenario

    data = {
        "name": "prefix-bench", "seed": 0,
        "workload": {"format": "mooncake", "path": str(TRACE.resolve()),
                     "num_requests": num_requests},
        "replica": {"model": "llama-3.1-8b", "gpu": "h100-sxm",
                    "scheduler": ({"name": "vllm_v1", "async_scheduling": False}
                                  if scheduler == "vllm_v1" else
                                  {"name": "sglang", "overlap_schedule": False}),
                    "latency": {"kind": "roofline"},
                    "kv_cache": {"block_size": 16, "num_blocks": num_blocks},
                    "prefix_caching": caching},
    }
    try:
        scenario = parse_scenario(data, "bench")
    except Exception:  # a checkout before async and overlap existed: it ran synchronously
        data["replica"]["scheduler"] = {"name": scheduler}
        scenario = parse_scenario(data, "bench")
    start = time.perf_counter()
    res = run_scenario(scenario)
    seconds = time.perf_counter() - start
    stats = res.summary.get("prefix_cache", {})
    return {"seconds": seconds, "peak_rss_mb": resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss / 1024, "hit_rate": stats.get("hit_rate_tokens", 0.0),
        "evicted": stats.get("num_evicted_blocks", 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 4000, 12031])
    parser.add_argument("--blocks", type=int, default=20_000)
    parser.add_argument("--scheduler", choices=["vllm_v1", "sglang"], default="vllm_v1")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(int(args.one[0]), args.one[1] == "on", args.blocks,
                             args.scheduler)))
        return
    print(f"{'requests':>8} {'caching':>7} {'seconds':>8} {'s/1k req':>8} {'peak MB':>8} "
          f"{'hit rate':>8} {'evicted':>9}")
    for n in args.sizes:
        for caching in ("off", "on"):
            out = subprocess.run([sys.executable, __file__, "--blocks", str(args.blocks),
                                  "--scheduler", args.scheduler, "--one", str(n), caching],
                                 capture_output=True, text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(f"{n:>8} {caching:>7} {r['seconds']:>8.2f} {r['seconds'] / n * 1000:>8.3f} "
                  f"{r['peak_rss_mb']:>8.0f} {r['hit_rate']:>8.3f} {r['evicted']:>9}")


if __name__ == "__main__":
    main()
