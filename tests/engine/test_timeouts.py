"""Client timeouts (`workload.timeout_s`): a request its client gives up on is aborted by the
engine at its first step from the deadline, from the queue or from the batch (its KV freed, the
KV of iterations in flight dropped), and counted failed with the reason; a request finishing
after its deadline fails too. Exact times on a constant-latency replica, the fast path equal to
stepping, the summary's counts and verdict, and the measured runs' timeout."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sim import run_scenario
from sim.config.scenario import parse_scenario
from sim.studies.measured import AIOHTTP_DEFAULT_TIMEOUT_S, _timeout_s
from tests.engine.fastpath_helpers import assert_same_results
from tests.helpers import TICK, disaggregated, replica, trace


def one_at_a_time(tmp_path, rows, timeout_s, engine="none", **extra):
    """A replica that runs one request at a time, each iteration TICK (0.25 s) long; no API
    front end unless `engine` has one."""
    return parse_scenario({
        "workload": {"format": "vidur", "path": trace(tmp_path, rows), "timeout_s": timeout_s},
        "replica": {**replica(max_num_seqs=1), "engine": engine}, "record_token_times": True,
        **extra}, "test")


def rows_by_id(results):
    return results.requests.set_index("request_id")


def test_requests_time_out_from_the_batch_and_the_queue_at_the_next_step(tmp_path):
    # r0 runs from 0 (a token at each TICK); r1 and r2 queue behind it. Timeout 1 s.
    scenario = one_at_a_time(tmp_path, [(0.0, 10, 8), (0.1, 10, 4), (0.6, 10, 1)], 1.0)
    res = run_scenario(scenario)
    req = rows_by_id(res)
    assert list(req["status"]) == ["failed", "failed", "finished"]
    # r0: tokens at 0.25, 0.5, 0.75 and 1.0 (the one at its deadline still reaches it), then
    # aborted before the next step; r1 starts at once and is aborted after its first token
    # (at 1.25, past its deadline 1.1); r2 starts then and finishes at 1.5, before 1.6.
    assert req.loc[0, "num_generated_tokens"] == 4
    assert req.loc[0, "failed_s"] == 1.0 and math.isnan(req.loc[0, "finish_s"])
    assert req.loc[0, "reason"] == ("client_timeout: gave up 1 s after arriving, running, "
                                    "4 of 8 tokens generated")
    assert req.loc[1, "first_scheduled_s"] == 1.0  # r0's KV freed at its abort
    assert req.loc[1, "num_generated_tokens"] == 1 and req.loc[1, "failed_s"] == 1.1
    assert req.loc[2, "first_scheduled_s"] == 1.25
    assert req.loc[2, "finish_s"] == 1.5 and math.isnan(req.loc[2, "failed_s"])
    tokens = res.tokens.groupby("request_id").size()
    assert tokens.tolist() == req["num_generated_tokens"].tolist()


def test_a_request_finishing_after_its_deadline_fails(tmp_path):
    # r1 queues behind r0 and would finish at 1.25 + 2 TICKs = 1.75; its deadline is 1.6.
    scenario = one_at_a_time(tmp_path, [(0.0, 10, 4), (0.6, 10, 3)], 1.0)
    req = rows_by_id(run_scenario(scenario))
    assert req.loc[0, "status"] == "finished" and req.loc[0, "finish_s"] == 1.0
    assert req.loc[1, "status"] == "failed" and req.loc[1, "failed_s"] == 1.6
    assert req.loc[1, "num_generated_tokens"] == 3
    assert req.loc[1, "reason"].startswith("client_timeout: gave up 1 s after arriving, its "
                                           "last token 0.15 s too late")


def test_an_answer_must_leave_the_engine_a_front_end_before_the_give_up(tmp_path):
    # With the default calibration's front end (7.8 ms), an answer finishing in the engine at
    # exactly the timeout reaches its client too late: failed at the give-up, 1.0 s.
    scenario = one_at_a_time(tmp_path, [(0.0, 10, 4), (0.0, 10, 3)], 1.0, engine="auto")
    req = rows_by_id(run_scenario(scenario))
    frontend_s = scenario.replica.frontend_latency_s
    assert frontend_s > 0
    assert req.loc[0, "status"] == "failed" and req.loc[0, "failed_s"] == 1.0
    assert req.loc[0, "reason"].endswith(f"its last token {frontend_s:.3g} s too late")
    assert req.loc[1, "status"] == "failed"  # queued behind it: its answer would come at 1.75
    # Nobody finished late: every finished request's client-side E2E is within the timeout.
    res = run_scenario(one_at_a_time(tmp_path, [(0.1 * i, 10, 1 + i % 5) for i in range(12)],
                                     1.0, engine="auto"))
    done = res.requests["status"] == "finished"
    assert done.any() and (res.requests.loc[done, "client_e2e_s"] <= 1.0).all()


def test_a_request_finishing_at_its_deadline_is_answered_and_its_session_goes_on():
    # Each turn takes exactly 1 s (4 iterations); the timeout is 1 s: every turn is in time,
    # and the timeouts, judging at the same instant, see its finish first.
    from tests.engine.test_sessions import conversations

    res = run_scenario(conversations(1, 3, workload={"timeout_s": 1.0}))
    assert (res.requests["status"] == "finished").all()


def test_a_queued_request_gives_up_and_never_runs(tmp_path):
    # r0 finishes at 0.5, its deadline; r1 then runs and r2 waits behind it, both past their
    # deadline (0.6) at the next step, 0.75.
    scenario = one_at_a_time(tmp_path, [(0.0, 10, 2), (0.1, 10, 4), (0.1, 10, 2)], 0.5)
    res = run_scenario(scenario)
    req = rows_by_id(res)
    assert list(req["status"]) == ["finished", "failed", "failed"]
    assert req.loc[1, "reason"].endswith("running, 1 of 4 tokens generated")
    assert req.loc[2, "reason"] == "client_timeout: gave up 0.5 s after arriving, queued"
    assert math.isnan(req.loc[2, "first_scheduled_s"]) and req.loc[2, "num_generated_tokens"] == 0
    summary = res.summary
    assert summary["requests"]["failed"] == 2 and summary["requests"]["finished"] == 1
    assert summary["requests"]["reasons"] == {"client_timeout": 2}
    # Throughput over the span to the last end, failed requests' included (as a benchmark
    # client counts it): 1 finished in 0.6 s.
    assert summary["throughput"]["requests_per_s"] == pytest.approx(1 / 0.6)


def test_timeouts_make_a_run_overloaded_and_are_counted_per_stage():
    data = {"seed": 1,
            "workload": {"format": "shared_prefix", "num_groups": 2, "num_prompts_per_group": 5,
                         "system_prompt_tokens": 64, "question_tokens": 64,
                         "output_tokens": 64, "hash_block_tokens": 16,
                         "stages": [{"rate_qps": 2, "duration_s": 20},
                                    {"rate_qps": 200, "duration_s": 2}],
                         "timeout_s": 2.0},
            "replica": {"scheduler": {"name": "vllm_v1", "max_num_seqs": 8},
                        "latency": {"kind": "roofline"}}}
    res = run_scenario(parse_scenario(data, "test"))
    first, second = res.summary["stages"]
    assert first["requests"]["failed"] == 0 and second["requests"]["failed"] > 100
    assert second["requests"]["finished"] + second["requests"]["failed"] == 400
    assert res.summary["overload"]["verdict"] == "overloaded"
    assert "requests failed: their client gave up" in res.summary["overload"]["detail"]
    # Finished requests all came back within the timeout; failed ones at it.
    req = res.requests
    done, failed = req["status"] == "finished", req["status"] == "failed"
    assert (req.loc[done, "e2e_s"] <= 2.0).all()
    assert np.allclose(req.loc[failed, "failed_s"] - req.loc[failed, "arrival_s"], 2.0)


@pytest.mark.parametrize("scheduler", [
    {"name": "vllm_v1"},  # async scheduling: placeholders in flight when aborted
    {"name": "vllm_v1", "async_scheduling": False},
    {"name": "sglang"},
    {"name": "chunked_prefill", "token_budget": 128},
])
def test_timeouts_fast_forward_as_stepping(scheduler):
    data = {"seed": 5,
            "workload": {"format": "synthetic", "num_requests": 300, "timeout_s": 2.0,
                         "arrivals": {"process": "poisson", "qps": 40},
                         "lengths": {"prompt": {"dist": "uniform", "low": 20, "high": 900},
                                     "output": {"dist": "uniform", "low": 1, "high": 100}}},
            "replica": {"scheduler": {**scheduler, "max_num_seqs": 8},
                        "latency": {"kind": "roofline"}, "prefix_caching": True,
                        "kv_cache": {"block_size": 16, "num_blocks": 900}},
            "record_token_times": True}
    scenario = parse_scenario(data, "test")
    fast, slow = run_scenario(scenario), run_scenario(scenario, fast_forward=False)
    assert_same_results(fast, slow)
    status = fast.requests["status"]
    assert (status == "failed").sum() > 20 and (status == "finished").sum() > 20
    # FCFS: the oldest waits until a slot frees, so most give up while running.
    assert fast.requests.loc[status == "failed", "reason"].str.contains("running").any()


def test_a_request_timing_out_in_transfer_fails_on_its_decode_replica(tmp_path):
    # A slow link: r0's KV arrives at 1.56 s, r1's (queued behind it on the link) at 2.87 s,
    # after both deadlines (2 s).
    scenario = disaggregated(tmp_path, [(0.0, 64, 6), (0.0, 64, 6)],
                             link={"bandwidth_gb_s": 0.0001, "latency_s": 0.0})
    scenario = scenario.model_copy(update={"workload": scenario.workload.model_copy(
        update={"timeout_s": 2.0})})
    fast, slow = run_scenario(scenario), run_scenario(scenario, fast_forward=False)
    assert_same_results(fast, slow)
    req = rows_by_id(fast)
    assert (req["status"] == "failed").all() and (req["failed_s"] == 2.0).all()
    # r0 decodes from 1.56 (tokens at 1.81 and 2.06, then aborted); r1 reaches its decode
    # replica after its deadline and is aborted there before any decode step.
    assert req["transfer_end_s"].round(2).tolist() == [1.56, 2.87]
    assert req["num_generated_tokens"].tolist() == [3, 1]
    assert fast.summary["replicas"][1]["busy_fraction"] is not None


def test_a_measured_tables_timeout_is_its_clients(tmp_path):
    path = tmp_path / "runs.csv"
    assert _timeout_s(path, {"request_timeout": "unset in config (aiohttp default total "
                                                "timeout 300 s)"}) == AIOHTTP_DEFAULT_TIMEOUT_S
    assert _timeout_s(path, {"request_timeout": "60"}) == 60.0
    assert _timeout_s(path, {"request_timeout": ""}) is None
    assert _timeout_s(path, {}) is None
    assert TICK == 0.25  # the exact times above assume it


def test_requests_outlasting_the_timeout_on_an_idle_server_are_not_overload():
    # One request every 5 s, outputs up to 2,500 tokens, 10 s timeout: the long ones fail
    # while running, with no queue; that is not overload (a capacity search would find 0).
    data = {"workload": {"format": "synthetic", "num_requests": 50, "timeout_s": 10.0,
                         "arrivals": {"qps": 0.2},
                         "lengths": {"prompt": {"dist": "uniform", "low": 10, "high": 500},
                                     "output": {"dist": "uniform", "low": 1, "high": 2500}}}}
    summary = run_scenario(parse_scenario(data, "test")).summary
    assert summary["requests"]["failed"] > 5
    assert summary["overload"]["verdict"] == "stable"
    assert "none after queueing" in summary["overload"]["detail"]
