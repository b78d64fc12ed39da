"""Record golden picks of SGLang 0.5.23's data-parallel controller (`managers/
data_parallel_controller.py`) for `tests/routers/test_sglang_dp_golden.py`, which replays them
through servesim's `sglang_dp` balancer.

    /root/venv-sglang/bin/python tools/golden/record_sglang_dp_balancer.py \
        --out tests/golden/sglang-0.5.23/dp_balancer.json

Each case is a random stream of requests (arrival times, prompt lengths) over 2-8 ranks whose
loads (running, waiting, tokens) drift at random, each rank publishing its load now and then.
SGLang's own `DPBudget` (its `update_budget`, which skips a snapshot whose timestamp it has
seen, and its `dispatch` with the optimistic bumps) picks the rank for `total_requests` and
`total_tokens`, named by `LoadBalanceMethod.from_str`. The controller's throttle around it
(`refresh_load_budget`: the ranks' latest snapshots read before a dispatch at most every
20 ms) is written out here as it reads, not run (its clock is `time.perf_counter`), and
`round_robin` (a counter) is left to servesim's unit tests. Each request is written with the
snapshots published since the one before (rank, running, waiting, tokens) and the rank
picked.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

REFRESH_S = 0.02  # `refresh_load_budget`'s throttle


@dataclass
class Snapshot:
    """The fields `DPBudget.update_budget` reads of a rank's published load."""

    dp_rank: int
    timestamp: float
    num_running_reqs: int
    num_waiting_reqs: int
    num_total_tokens: int


def record_case(seed: int, method: str) -> dict:
    from sglang.srt.managers.data_parallel_controller import DPBudget, LoadBalanceMethod

    rng = random.Random(seed)
    num_ranks = rng.randint(2, 8)
    num_requests = rng.randint(20, 60)
    loads = [[rng.randint(0, 20), rng.randint(0, 5), rng.randint(0, 50_000)]
             for _ in range(num_ranks)]
    latest: dict[int, Snapshot] = {}  # each rank's last published snapshot
    budget = DPBudget(num_ranks)
    lb = LoadBalanceMethod.from_str(method)
    last_refresh = -1.0
    now = 1.0  # (SGLang's clock, perf_counter, is never 0: its first timestamps are 0.0)
    events = []
    for _ in range(num_requests):
        now += rng.choice([0.0, 0.001, 0.005, 0.015, 0.03, 0.2])
        published = []
        for rank, load in enumerate(loads):  # loads drift between arrivals (or not: a burst)
            if rng.random() < 0.5:
                load[0] = max(0, load[0] + rng.randint(-3, 3))
                load[1] = max(0, load[1] + rng.randint(-2, 2))
                load[2] = max(0, load[2] + rng.randint(-4000, 4000))
            if rng.random() < 0.4 and (rank not in latest or latest[rank].timestamp != now):
                latest[rank] = Snapshot(rank, now, *load)
                published.append([rank, *load])
        prompt = rng.randint(1, 8000)
        if now - last_refresh >= REFRESH_S:
            last_refresh = now
            budget.update_budget(list(latest.values()))
        pick = budget.dispatch(lb, estimated_tokens=prompt)
        events.append({"t": now, "prompt": prompt, "published": published, "pick": pick})
    return {"seed": seed, "method": method, "num_ranks": num_ranks, "events": events}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import sglang

    cases = [record_case(seed, method) for method in ("total_requests", "total_tokens")
             for seed in range(16)]
    args.out.write_text(json.dumps({"sglang": sglang.__version__, "cases": cases},
                                   separators=(",", ":")) + "\n")
    print(f"{len(cases)} cases, {sum(len(c['events']) for c in cases)} picks -> {args.out}")


if __name__ == "__main__":
    main()
