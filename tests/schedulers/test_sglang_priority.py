"""SGLang's priority scheduling (`enable_priority_scheduling`) on a constant step, exactly: the
queue by priority (higher first, or lower with `schedule_low_priority_values_first`) then by
when each request entered it; a waiting request preempting running ones only when the batch is
full by count and only those it beats by more than the threshold, the least preferred and
latest to enter first; a victim back at the end of its level with its outputs kept. Step for
step against SGLang's own scheduler: the `priority_*` fixtures of tests/golden/sglang-0.5.23."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.config.scenario import parse_scenario
from sim.core.request import Request, Status
from sim.core.waiting import EntryOrderWaiting
from sim.engine.cluster import Cluster
from tests.helpers import assert_one_line_error, run_cli

STEP_S = 0.01


def run(requests: list[Request], max_running: int = 1, **scheduler) -> list[Request]:
    data = {"name": "p", "workload": {"format": "synthetic", "num_requests": 1,
                                      "arrivals": {"process": "poisson", "qps": 1.0},
                                      "lengths": {"prompt": {"dist": "fixed", "value": 1},
                                                  "output": {"dist": "fixed", "value": 1}}},
            "replica": {"scheduler": {"name": "sglang", "max_running_requests": max_running,
                                      "overlap_schedule": False,
                                      "enable_priority_scheduling": True, **scheduler},
                        "latency": {"kind": "constant", "iteration_s": STEP_S},
                        "kv_cache": {"block_size": 1, "num_blocks": 10_000},
                        "engine": "none"}}
    Cluster(parse_scenario(data, "test"), fast_forward=True).run(requests)
    assert all(r.status is Status.FINISHED for r in requests)
    return requests


def req(rid: int, arrival_s: float, priority: int, prompt: int = 4, output: int = 3
        ) -> Request:
    return Request(rid, arrival_s, prompt, output, priority=priority)


def finish_order(requests: list[Request]) -> list[int]:
    return [r.request_id for r in sorted(requests, key=lambda r: (r.finish_s, r.request_id))]


def test_the_queue_is_served_by_priority_higher_first_then_entry():
    # r0 runs (3 steps, one at a time); r1..r3 queue behind it, 5 or fewer levels apart
    # (within the threshold of 10: no preemption): r2 and r3 (level 5, in arrival order),
    # then r1.
    reqs = run([req(0, 0.0, 0), req(1, 0.001, 1), req(2, 0.002, 5), req(3, 0.003, 5)])
    assert finish_order(reqs) == [0, 2, 3, 1]
    assert all(r.num_preemptions == 0 for r in reqs)
    low = run([req(0, 0.0, 0), req(1, 0.001, 1), req(2, 0.002, 5), req(3, 0.003, 5)],
              schedule_low_priority_values_first=True)
    assert finish_order(low) == [0, 1, 2, 3]


@pytest.mark.parametrize(("level", "preempts"), [(10, False), (11, True)])
def test_a_request_preempts_only_beyond_the_threshold(level, preempts):
    """r0 (level 0, 10 tokens out) runs alone in a batch of one; r1 arrives at 15 ms. Beating
    r0 by 10 (the default threshold) it waits; by 11 it preempts r0 at the 20 ms pass: r1's
    prompt 20-30 ms, its decode to 40 ms; r0 then prefills its prompt and two outputs again
    (its third token at 50 ms) and decodes its 7 others."""
    r0, r1 = req(0, 0.0, 0, output=10), req(1, 0.015, level, output=2)
    run([r0, r1])
    assert (r0.num_preemptions == 1) is preempts
    if preempts:
        assert r1.finish_s == pytest.approx(0.04)
        assert r0.finish_s == pytest.approx(0.04 + 8 * STEP_S)
        assert r0.num_recomputed_tokens == 4 + 1  # its prompt and its first decode
    else:
        assert r1.finish_s == pytest.approx(0.10 + 2 * STEP_S)


def test_the_victim_is_the_least_preferred_and_latest_to_enter():
    # Two running at level 0 (r0 entered first), r2 at level 40 arrives with the batch full:
    # it preempts r1 (the later); r0 runs on.
    r0, r1 = req(0, 0.0, 0, output=10), req(1, 0.001, 0, output=10)
    r2 = req(2, 0.025, 40, output=2)
    run([r0, r1, r2], max_running=2)
    assert (r0.num_preemptions, r1.num_preemptions, r2.num_preemptions) == (0, 1, 0)
    # A level 20 running beside one at 0: the level-0 one goes, though it entered first.
    a, b = req(0, 0.0, 0, output=10), req(1, 0.001, 20, output=10)
    c = req(2, 0.025, 40, output=2)
    run([a, b, c], max_running=2)
    assert (a.num_preemptions, b.num_preemptions) == (1, 0)


def test_a_victim_goes_to_the_end_of_its_level():
    queue = EntryOrderWaiting()
    a, b, c = req(0, 0.0, 5), req(1, 0.1, 5), req(2, 0.2, 9)
    for r in (a, b, c):
        queue.append(r)
    assert [r.request_id for r in queue] == [2, 0, 1]
    queue.remove(a)
    queue.appendleft(a)  # (preempted: it enters again)
    assert [r.request_id for r in queue] == [2, 1, 0]


def test_without_preemption_the_queue_is_still_by_priority():
    r0, r1 = req(0, 0.0, 0, output=10), req(1, 0.015, 40, output=2)
    run([r0, r1], disable_priority_preemption=True)
    assert r0.num_preemptions == 0 and r1.finish_s > r0.finish_s


def test_a_victim_leaves_a_mixed_batch():
    """With mixed_chunk the running decodes join the prefill batch first: a victim of the
    pass is taken out of it again (SGLang mixes the running batch in after preempting)."""
    r0, r1 = req(0, 0.0, 0, output=10), req(1, 0.015, 40, output=2)
    run([r0, r1], mixed_chunk=True)
    assert r0.num_preemptions == 1 and r1.finish_s < r0.finish_s


@pytest.mark.parametrize(("change", "field", "needle"), [
    ({"replica": {"parallelism": {"pipeline": 2}}}, "scheduler.enable_priority_scheduling",
     "pipeline stages"),
    ({"cluster": {"prefill": {"replicas": 1},
                  "decode": {"replicas": 1, "replica": {"parallelism": {"pipeline": 2}}}}},
     "cluster.decode.replica.scheduler.enable_priority_scheduling", "pipeline stages"),
    ({"replica": {"scheduler": {"decode_reserve_tokens": 0}}},
     "scheduler.decode_reserve_tokens", "disable_priority_preemption"),
    ({"replica": {"scheduler": {"priority_scheduling_preemption_threshold": -1}}},
     "scheduler.priority_scheduling_preemption_threshold", "-1"),
])
def test_what_priority_preemption_does_not_model_is_refused(tmp_path, monkeypatch, capsys,
                                                            change, field, needle):
    import yaml

    from sim.config.scenario import merge_mappings

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(merge_mappings({
        "name": "p", "workload": {"format": "synthetic", "num_requests": 4,
                                  "arrivals": {"process": "poisson", "qps": 1.0},
                                  "lengths": {"prompt": {"dist": "fixed", "value": 8},
                                              "output": {"dist": "fixed", "value": 2}}},
        "replica": {"scheduler": {"name": "sglang", "enable_priority_scheduling": True}}},
        change)))
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path), "--out", str(tmp_path / "o"))
    assert_one_line_error(code, err, field, needle)


GOLDEN = Path(__file__).parents[1] / "golden" / "sglang-0.5.23"


@pytest.mark.parametrize(("name", "change"), [
    ("priority_queue", {"enable_priority_scheduling": False}),
    ("priority_preempt", {"priority_scheduling_preemption_threshold": 10**9}),
    ("priority_preempt_overlap", {"priority_scheduling_preemption_threshold": 10**9}),
    ("priority_low_first_chunked", {"schedule_low_priority_values_first": False}),
    ("priority_kv_starved", {"priority_scheduling_preemption_threshold": 10**9}),
    ("priority_kv_starved_overlap", {"priority_scheduling_preemption_threshold": 10**9}),
    ("priority_distinct_levels", {"priority_scheduling_preemption_threshold": 10**9}),
])
def test_the_priority_fixtures_hang_on_the_rule_they_check(name, change):
    """Each fixture, replayed without the rule it is aimed at (priorities, preemption, the
    direction), differs from what SGLang did: the fixtures check the rules."""
    from tools.golden.fixture import read_fixture
    from tools.golden.replay import first_divergence, replay

    doc = read_fixture(GOLDEN / f"{name}.json.gz")
    assert first_divergence(doc, replay(doc)) is None
    doc["workload"]["settings"].update(change)
    assert first_divergence(doc, replay(doc)) is not None
