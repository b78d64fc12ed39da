"""The `shared_prefix` workload format: inference-perf's generator as its client sends it (fixed
prompts cycled, a fixed count of requests spanning the stage), and the prefix-block ids a
prefix cache reads."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from sim import run_scenario
from sim.config.errors import InputError
from sim.config.scenario import parse_scenario
from sim.results.metrics.overload import overload
from sim.workloads import Workload
from sim.workloads.load import load_workload

BASE = {"format": "shared_prefix", "num_groups": 3, "num_prompts_per_group": 4,
        "system_prompt_tokens": 100, "question_tokens": 250, "output_tokens": 20,
        "rate_qps": 5.0, "duration_s": 60.0}


def workload(seed: int = 0, **fields: Any) -> Workload:
    return load_workload(parse_scenario({"seed": seed, "workload": {**BASE, **fields}}, "test"))


def test_a_stage_sends_rate_times_duration_requests_spanning_it():
    w = workload()
    assert len(w.arrival_s) == 300
    assert w.arrival_s[0] == 0.0 and (np.diff(w.arrival_s) > 0).all()
    # The gaps are rescaled to sum to the stage: the last request leaves one gap before its end.
    assert 59.0 < w.arrival_s[-1] < 60.0
    assert (w.num_prompt_tokens == 350).all() and (w.num_output_tokens == 20).all()
    assert not np.array_equal(workload(seed=1).arrival_s, w.arrival_s)


def test_prompts_repeat_in_one_shuffled_order_and_groups_share_system_prompts():
    w = workload()
    ids = w.hash_ids
    assert ids is not None and w.hash_block_tokens == 16
    m, num_full = 100 // 16, 350 // 16  # 6 blocks inside a system prompt, 21 full in all
    assert all(len(i) == num_full + 1 for i in ids)  # and a partial last block
    # Request n sends prompt n mod 12: the same full blocks 12 requests apart, a new partial.
    for n in range(len(ids) - 12):
        assert ids[n][:num_full] == ids[n + 12][:num_full]
        assert ids[n][num_full] != ids[n + 12][num_full]
    first = [i[:num_full] for i in ids[:12]]
    assert len(set(first)) == 12  # twelve distinct prompts, each once per cycle
    groups = {i[:m] for i in first}
    assert len(groups) == 3  # three system prompts, four prompts each
    assert sorted(sum(i[:m] == g for i in first) for g in groups) == [4, 4, 4]
    # Beyond the system prompt, no block is shared between prompts.
    own = [set(i[m:]) for i in first]
    assert all(not (a & b) for k, a in enumerate(own) for b in own[k + 1:])
    # A different seed deals the prompts in another order.
    other = workload(seed=1).hash_ids
    assert other is not None and [i[:num_full] for i in other[:12]] != first


def test_vllm_prefix_caching_hits_every_full_block_of_a_repeated_prompt():
    """Run on vLLM v1 with prefix caching: after the first cycle, each request finds its whole
    prompt but the last partial block cached (336 of 350 tokens); the first 12 find their
    group's system-prompt blocks at most."""
    res = run_scenario(parse_scenario({
        "workload": {**BASE, "rate_qps": 2.0},
        "replica": {"model": "tiny", "latency": {"kind": "constant", "iteration_s": 0.005},
                    "scheduler": {"name": "vllm_v1", "max_num_batched_tokens": 512},
                    "prefix_caching": True}}, "test"))
    cached = res.requests.sort_values("arrival_s")["num_cached_tokens"].to_numpy()
    assert (cached[:12] <= 96).all()
    assert (cached[12:] == 336).all()


@pytest.mark.parametrize("fields, field", [
    ({"rate_qps": 0.01, "duration_s": 10.0}, "duration_s"),
    ({"question_tokens": 10**7}, "hash_block_tokens"),  # 1.9e8 ids: gigabytes
    ({"question_tokens": 10**9}, "question_tokens"),
])
def test_a_stage_that_cannot_be_sent_is_refused(fields, field):
    with pytest.raises(InputError) as info:
        workload(**fields)
    assert field in str(info.value)


STAGES = [{"rate_qps": 5.0, "duration_s": 20.0}, {"rate_qps": 10.0, "duration_s": 10.0}]


def test_stages_follow_one_another_each_from_the_first_prompt():
    fields = {k: v for k, v in BASE.items() if k not in ("rate_qps", "duration_s")}
    w = load_workload(parse_scenario({"seed": 0, "workload": {
        **fields, "stages": STAGES, "stage_gap_s": 7.0}}, "test"))
    assert w.stage is not None
    first, second = w.stage == 0, w.stage == 1
    assert first.sum() == 100 and second.sum() == 100
    assert (np.diff(w.arrival_s) > 0).all()
    # The second stage's first send comes stage_gap_s after the first stage's last.
    start = w.arrival_s[second][0]
    assert start - w.arrival_s[first][-1] == pytest.approx(7.0)
    assert start + 9.0 < w.arrival_s[-1] < start + 10.0
    # Each stage starts again at prompt 0 of the one shuffled order.
    ids = w.hash_ids
    assert ids is not None
    num_full = 350 // 16
    assert [i[:num_full] for i in ids[100:112]] == [i[:num_full] for i in ids[:12]]


def test_a_run_in_stages_reports_each_stage():
    fields = {k: v for k, v in BASE.items() if k not in ("rate_qps", "duration_s")}
    res = run_scenario(parse_scenario({"workload": {**fields, "stages": STAGES,
                                                    "stage_gap_s": 30.0},
                                       "replica": {"model": "llama-2-7b"}}, "test"))
    stages = res.summary["stages"]
    assert [s["rate_qps"] for s in stages] == [5.0, 10.0]
    assert [s["requests"] for s in stages] == [{"total": 100, "finished": 100, "failed": 0}] * 2
    stage = res.requests["stage"]
    for i, s in enumerate(stages):
        rows = (stage == i) & (res.requests["status"] == "finished")
        assert s["ttft_s"]["mean"] == pytest.approx(float(res.requests["ttft_s"][rows].mean()))
        assert s["ttft_s"]["count"] == 100
        # The stage's queue alone is judged (its own requests, to the run's end).
        table = {name: np.asarray(res.requests[name])[(stage == i).to_numpy()]
                 for name in res.requests.columns}
        assert s["overload"] == overload(table, res.summary["run"]["end_s"])
        # Finished requests per second of the stage, from its first send to its last finish.
        span = res.requests["finish_s"][rows].max() - res.requests["arrival_s"][rows].min()
        assert s["requests_per_s"] == pytest.approx(100 / span)
    # A one-stage workload has no stages section.
    assert "stages" not in run_scenario(parse_scenario(
        {"workload": {**BASE, "duration_s": 10.0}}, "test")).summary


@pytest.mark.parametrize(("fields", "field"), [
    ({"stages": STAGES}, "workload.stages"),  # besides rate_qps and duration_s
    ({"rate_qps": None}, "workload.rate_qps"),
    ({"stages": [{"rate_qps": 5.0, "duration_s": 0.01}], "rate_qps": None, "duration_s": None},
     "workload.stages.0.duration_s"),
])
def test_stages_or_one_rate_but_not_both(fields: dict[str, Any], field: str):
    data = {k: v for k, v in {**BASE, **fields}.items() if v is not None}
    with pytest.raises(InputError) as err:
        parse_scenario({"workload": data}, "test.yaml")
    assert err.value.field == field
