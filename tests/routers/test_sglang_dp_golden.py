"""servesim's `sglang_dp` balancer against SGLang 0.5.23's own code: the picks its controller's
`DPBudget` made on random streams of requests and published loads
(`tools/golden/record_sglang_dp_balancer.py`; its 20 ms throttle written out there), replayed
pick for pick."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sim.core.request import Request
from sim.routers.base import ReplicaLoad
from sim.routers.sglang_dp import SGLangDataParallel, SGLangDataParallelConfig
from tests.helpers import REPO

GOLDEN = json.loads((REPO / "tests/golden/sglang-0.5.23/dp_balancer.json").read_text())


@pytest.mark.parametrize("case", GOLDEN["cases"],
                         ids=lambda c: f"{c['method']}-{c['seed']}")
def test_sglang_dp_balancer_picks_as_sglangs_controller(case):
    balancer = SGLangDataParallel(
        SGLangDataParallelConfig(name="sglang_dp", load_balance_method=case["method"]),
        np.random.default_rng(0), published=True)
    # (The balancer reads published loads only: what the ranks hold now is not looked at.)
    unread = [ReplicaLoad(0, 10**9, 0, 10**6, 0)] * case["num_ranks"]
    picks = []
    for i, event in enumerate(case["events"]):
        for rank, running, waiting, tokens in event["published"]:
            balancer.publish(rank, ReplicaLoad(running + waiting, tokens, 0, waiting, running),
                             event["t"])
        picks.append(balancer.choose_at(Request(i, event["t"], event["prompt"], 1), unread,
                                        event["t"]))
    assert picks == [event["pick"] for event in case["events"]]


def test_the_golden_streams_exercise_each_rule():
    """Ties, bursts within 20 ms (the bumps stand) and ranks that publish nothing between
    reads (their bumps kept) all occur in the recorded streams."""
    assert GOLDEN["sglang"] == "0.5.23"
    methods = {case["method"] for case in GOLDEN["cases"]}
    assert methods == {"total_requests", "total_tokens"}
    gaps = [b["t"] - a["t"] for case in GOLDEN["cases"]
            for a, b in zip(case["events"][:-1], case["events"][1:], strict=True)]
    assert min(gaps) == 0.0 and max(gaps) > 0.02
    assert any(not event["published"] for case in GOLDEN["cases"] for event in case["events"])
