"""Why iterations are stepped rather than fast-forwarded, counted, and what each kind costs.

Runs `bench/cluster_scaling.py`'s generated case (chunked prefill, 512-token budget,
Llama-3.1-8B H100 roofline, least_kv_load, Poisson 14 req/s per replica, Azure conversation
lengths) in process, with `FastReplica._next_work` wrapped, and prints two tables:

- at each plan a replica steps instead of opening a stretch, why (the first rule of
  `FastReplica._next_work` it fails): requests waiting (with the plan's budget all taken or
  not), not every running request scheduled, a prompt's chunk where work may come before it
  ends, `plan_stretch` refusing (a second prompt, blocks);
- each stepped plan against the same replica's previous plan: a continuation (the same
  requests, the same tokens each: what a stretch would cover, were it free), or a decision of
  the policy (a request admitted, a prompt's chunk changed: its last, or one token more where
  a decode left), with the time (`perf_counter`, about 0.2 us per wrapped call added) spent
  planning and committing each kind, the stretches' and the router's reads.

    python bench/stepped_reasons.py [--num-requests 20000] [--replicas 16]

bench/README.md ("Issue 48: why iterations are stepped on 16 replicas") quotes its numbers.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import sim.engine.fastpath.replica as fast  # noqa: E402
import sim.engine.replica as reference  # noqa: E402
from sim.config.scenario import parse_scenario  # noqa: E402
from sim.engine.fastpath.stretch import Stretch  # noqa: E402
from sim.runner import run_scenario  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=20_000)
    parser.add_argument("--replicas", type=int, default=16)
    parser.add_argument("--qps-per-replica", type=float, default=14.0)
    args = parser.parse_args()
    from cluster_scaling import CONV_LENGTHS, generated

    scenario = parse_scenario(generated(args.num_requests, args.replicas,
                                        args.qps_per_replica, CONV_LENGTHS),
                              "bench/stepped_reasons.py")
    why: Counter[str] = Counter()
    kind: Counter[str] = Counter()
    cost: Counter[str] = Counter()
    clock = time.perf_counter
    previous: dict[int, dict[int, int]] = {}  # replica -> its last stepped plan's tokens
    kind_of: dict[int, str] = {}  # id(iteration) -> its kind, for its commit
    refused: list[str] = []
    next_work, plan_stretch = fast.FastReplica._next_work, fast.plan_stretch
    commit, commit_stretch = reference.Replica._commit, fast.commit_stretch
    load = fast.FastReplica.load

    def wrapped_plan_stretch(state: Any, plan: Any, *a: Any, **k: Any) -> Any:
        stretch = plan_stretch(state, plan, *a, **k)
        if stretch is None:
            refused.append("plan_stretch refused: a second prompt" if len(state.prefilling()) > 1
                           else "plan_stretch refused: blocks, or a one-token recompute")
        return stretch

    def wrapped_next_work(self: Any, now_s: float) -> Any:
        state = self.state
        refused.clear()
        start = clock()
        plan, work = next_work(self, now_s)
        elapsed = clock() - start
        rid = self.replica_id
        if work is None or plan is None:
            previous.pop(rid, None)
            return plan, work
        if isinstance(work, Stretch):
            previous.pop(rid, None)
            why["(a stretch)"] += 1
            cost["stretch: plan"] += elapsed
            return plan, work
        budget = self.scheduler.max_num_scheduled_tokens
        if state.waiting:
            full = budget is not None and plan.total_num_scheduled_tokens >= budget
            reason = f"requests waiting, the budget {'all taken' if full else 'not all taken'}"
        elif plan.num_seqs != len(state.running):
            reason = "not every running request scheduled"
        elif refused:
            reason = refused[0]
        elif plan.total_num_scheduled_tokens > plan.num_seqs:
            reason = "a prompt's chunk, work may come before it ends"
        else:
            reason = "other (a sequential latency model, a policy reading the clock, ...)"
        why[reason] += 1
        tokens = dict(plan.num_scheduled_tokens)
        before = previous.get(rid)
        if before is None:
            what = "after a stretch or idle"
        elif tokens == before:
            what = "continuation, " + ("requests waiting" if state.waiting else "nothing waits")
        elif set(tokens) - set(before):
            what = "decision: a request admitted"
        elif set(before) - set(tokens):
            what = "decision: a request left, a chunk changed"
        else:
            what = "decision: a chunk changed (a prompt's last, or one turned decode)"
        previous[rid] = tokens
        kind[what] += 1
        kind_of[id(work)] = what
        cost[what + ": plan"] += elapsed
        return plan, work

    def wrapped_commit(self: Any, it: Any) -> None:
        start = clock()
        commit(self, it)
        cost[kind_of.pop(id(it), "?") + ": commit"] += clock() - start

    def wrapped_commit_stretch(*a: Any) -> Any:
        start = clock()
        out = commit_stretch(*a)
        cost["stretch: commit"] += clock() - start
        return out

    def wrapped_load(self: Any, req: Any = None) -> Any:
        start = clock()
        out = load(self, req)
        cost["router: a replica's load"] += clock() - start
        return out

    fast.FastReplica._next_work = wrapped_next_work  # type: ignore[method-assign]
    fast.plan_stretch = wrapped_plan_stretch
    reference.Replica._commit = wrapped_commit  # type: ignore[method-assign]
    fast.commit_stretch = wrapped_commit_stretch
    fast.FastReplica.load = wrapped_load  # type: ignore[method-assign]
    start_cpu = time.process_time()
    res = run_scenario(scenario)
    cpu = time.process_time() - start_cpu
    print(f"{args.num_requests:,} requests on {args.replicas} replicas: "
          f"{res.summary['num_iterations']:,} iterations, {cpu:.2f} s CPU (wrapped)")
    print("\nwhy a plan is stepped:")
    for name, n in why.most_common():
        print(f"  {n:>9,}  {name}")
    print("\na stepped plan against the replica's previous one:")
    for name, n in kind.most_common():
        print(f"  {n:>9,}  {name}")
    print("\ntime (s):")
    for name, s in sorted(cost.items()):
        print(f"  {s:9.3f}  {name}")


if __name__ == "__main__":
    main()
