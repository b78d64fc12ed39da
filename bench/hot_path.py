"""Where a run's time goes: calls, total and per-call cost of the engine's hot calls.

bench/README.md ("Where the time goes") quotes these numbers; this prints them for a case, so a
change to the hot path can be judged call by call, not only by a whole run's wall time. Each
call below is wrapped with `perf_counter` (about 0.2 us per call added; nested calls are counted
in their callers too, e.g. `schedule` inside neither `_plan_iteration` nor `_commit`), and the
run is timed again unwrapped for its wall.

    python bench/hot_path.py [--case azure|azure_v1|cluster16] [--num-requests N]

- `azure`: the Azure 2023 conversation hour (19,366 requests) on one H100 replica, chunked
  prefill with a 512-token budget (`bench/sim_speed.py`'s case); `azure_v1`: the same, vLLM v1.
- `cluster16`: generated requests on 16 colocated replicas with least_kv_load routing at 14
  req/s per replica (`bench/cluster_scaling.py`'s case; 30,000 requests unless told).

Measure on one core (`taskset -c 0`), with nothing else running: the per-call costs move with
the VM's load as the whole run does.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import sim.engine.cluster  # noqa: E402
import sim.engine.fastpath.replica  # noqa: E402
import sim.engine.replica  # noqa: E402
from sim.config.scenario import parse_scenario  # noqa: E402
from sim.core.state import ReplicaState  # noqa: E402
from sim.runner import run_scenario  # noqa: E402

Counter = dict[str, list[float]]  # name -> [calls, seconds]


def wrap(owner: Any, attr: str, name: str, counts: Counter) -> Callable[[], None]:
    """Time every call of `owner.attr`; return what undoes it."""
    original = getattr(owner, attr)
    entry = counts.setdefault(name, [0, 0.0])
    clock = time.perf_counter

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return original(*args, **kwargs)
        finally:
            entry[0] += 1
            entry[1] += clock() - start

    setattr(owner, attr, timed)
    return lambda: setattr(owner, attr, original)


def scenario(case: str, num_requests: int | None) -> Any:
    if case in ("azure", "azure_v1"):
        from sim_speed import CHUNKED, DEFAULT_TRACE
        from sim_speed import scenario as azure
        sched = CHUNKED if case == "azure" else {"name": "vllm_v1"}
        return azure(DEFAULT_TRACE, case, sched, num_requests=num_requests)
    from cluster_scaling import CONV_LENGTHS, generated
    return parse_scenario(generated(num_requests or 30_000, 16, 14.0, CONV_LENGTHS),
                          "bench/hot_path.py")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--case", choices=["azure", "azure_v1", "cluster16"], default="azure")
    parser.add_argument("--num-requests", type=int, default=None)
    args = parser.parse_args()
    sc = scenario(args.case, args.num_requests)
    run_scenario(sc)  # warm: tables, caches, imports
    start = time.perf_counter()
    res = run_scenario(sc)
    wall = time.perf_counter() - start

    counts: Counter = {}
    undo = [
        wrap(sim.engine.fastpath.replica, "plan_stretch", "plan_stretch", counts),
        wrap(sim.engine.fastpath.replica, "commit_stretch", "commit_stretch", counts),
        wrap(sim.engine.replica.Replica, "_plan_iteration", "_plan_iteration (shape, latency)",
             counts),
        wrap(ReplicaState, "commit", "ReplicaState.commit", counts),
        wrap(sim.engine.fastpath.replica.FastReplica, "load", "Replica.load (router reads)",
             counts),
        wrap(sim.engine.cluster.Cluster, "route", "Cluster.route", counts),
    ]
    # The policy's decide(), whichever class it is.
    from sim.schedulers.base import SCHEDULERS
    scheduler_class = SCHEDULERS.get(sc.replica.scheduler.name)
    undo.append(wrap(scheduler_class, "decide", f"{scheduler_class.__name__}.decide",
                     counts))
    start = time.perf_counter()
    run_scenario(sc)
    wrapped_wall = time.perf_counter() - start
    for u in undo:
        u()

    s = res.summary
    print(f"case {args.case}: {s['requests']['total']:,} requests, "
          f"{s['num_iterations']:,} iterations; wall {wall:.2f} s "
          f"({wrapped_wall:.2f} s wrapped)")
    print(f"{'call':<36} {'calls':>9} {'total s':>8} {'us/call':>8} {'of wall':>8}")
    for name, (calls, seconds) in sorted(counts.items(), key=lambda kv: -kv[1][1]):
        if calls:
            print(f"{name:<36} {int(calls):>9,} {seconds:>8.3f} {seconds / calls * 1e6:>8.1f} "
                  f"{seconds / wrapped_wall:>8.0%}")


if __name__ == "__main__":
    main()
