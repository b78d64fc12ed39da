"""vLLM's priority policy (`scheduling_policy: priority`) on a constant step, exactly: the
queue served by priority then arrival, a preempted request going back in that order, and
the lowest priority (not the newest) preempted when KV runs out."""

from __future__ import annotations

import pytest

from sim.config.scenario import parse_scenario
from sim.core.request import Request
from sim.core.waiting import PriorityWaiting
from sim.engine.cluster import Cluster

STEP_S = 0.01


def run(policy: str, requests: list[Request], num_blocks: int = 10_000,
        max_num_seqs: int = 1) -> list[Request]:
    data = {"name": "p", "workload": {"format": "synthetic", "num_requests": 1,
                                      "arrivals": {"process": "poisson", "qps": 1.0},
                                      "lengths": {"prompt": {"dist": "fixed", "value": 1},
                                                  "output": {"dist": "fixed", "value": 1}}},
            "replica": {"scheduler": {"name": "vllm_v1", "scheduling_policy": policy,
                                      "max_num_seqs": max_num_seqs,
                                      "async_scheduling": False},
                        "latency": {"kind": "constant", "iteration_s": STEP_S},
                        "kv_cache": {"block_size": 1, "num_blocks": num_blocks},
                        "engine": "none"}}
    Cluster(parse_scenario(data, "test"), fast_forward=True).run(requests)
    return requests


def req(rid: int, arrival_s: float, priority: int, prompt: int = 4, output: int = 3
        ) -> Request:
    return Request(rid, arrival_s, prompt, output, priority=priority)


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_the_queue_is_served_by_priority_then_arrival(policy):
    # One runs at a time: r0 (3 iterations), then the queue of r1 (priority 1, first),
    # r2 (priority 0) and r3 (priority 0, last).
    done = run(policy, [req(0, 0.0, 1), req(1, 0.001, 1), req(2, 0.002, 0), req(3, 0.003, 0)])
    first = {r.request_id: r.first_scheduled_s for r in done}
    order = [2, 3, 1] if policy == "priority" else [1, 2, 3]
    assert first[0] == 0.0
    for k, rid in enumerate(order):
        assert first[rid] == pytest.approx((k + 1) * 3 * STEP_S, abs=1e-12)


def test_the_lowest_priority_is_preempted_not_the_newest():
    # 20 usable slots (one block is vLLM's null block): r0 (priority 1) and then r1
    # (priority 0) need 4 + 9 slots each at their largest, so one is preempted on the way.
    def both(policy: str) -> list[Request]:
        return run(policy, [req(0, 0.0, 1, output=10), req(1, 0.001, 0, output=10)],
                   num_blocks=21, max_num_seqs=2)

    r0, r1 = both("priority")
    assert r0.num_preemptions >= 1 and r1.num_preemptions == 0
    assert r1.finish_s < r0.finish_s
    f0, f1 = both("fcfs")  # the newest goes: r1
    assert f1.num_preemptions >= 1 and f0.num_preemptions == 0


def test_the_waiting_queue_keeps_vllms_order():
    queue = PriorityWaiting()
    late_urgent, early, early_urgent = req(5, 2.0, 0), req(7, 1.0, 3), req(9, 1.0, 0)
    for r in (early, late_urgent, early_urgent):
        queue.append(r)
    assert list(queue) == [early_urgent, late_urgent, early]
    queue.appendleft(req(1, 0.5, 3))  # a preempted one goes back by its priority
    assert [r.request_id for r in queue] == [9, 5, 1, 7]
    assert queue.popleft() is early_urgent and queue[0] is late_urgent and len(queue) == 3
