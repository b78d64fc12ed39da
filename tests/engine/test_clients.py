"""Closed-loop clients (`clients:`): exact send times on a constant-latency replica (worked by
hand), think times, pacing by the workload's own arrivals, the API front end, rejections and
timeouts freeing their client, the horizon, and the fast path equal to stepping."""

from __future__ import annotations

import numpy as np
import pytest

from sim import run_scenario
from sim.config.scenario import parse_scenario
from tests.engine.fastpath_helpers import assert_same_results
from tests.helpers import (
    TICK,
    assert_one_line_error,
    max_in_flight,
    replica,
    run_cli,
    run_cli_out,
    trace,
)


def closed_loop(tmp_path, rows, clients, **extra):
    """Requests of `rows` on one tiny replica, each iteration TICK (0.25 s) long, no API
    front end (`engine: none`): a request of prompt 10 and output 4 takes 4 iterations."""
    return parse_scenario({
        "workload": {"format": "vidur", "path": trace(tmp_path, rows)},
        "replica": {**replica(), "engine": "none", **extra.pop("replica", {})},
        "clients": clients, "record_token_times": True, **extra}, "test")


def run_both(scenario):
    fast, slow = run_scenario(scenario), run_scenario(scenario, fast_forward=False)
    assert_same_results(fast, slow)
    return fast


def test_two_clients_send_the_next_request_as_each_answer_comes(tmp_path):
    # Two in flight at a time, batched together: each pair takes 1 s, then the next pair goes.
    res = run_both(closed_loop(tmp_path, [(0.1 * i, 10, 4) for i in range(6)],
                               {"concurrency": 2}))
    req = res.requests
    assert req["arrival_s"].tolist() == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]
    assert req["ttft_s"].tolist() == [TICK] * 6 and req["e2e_s"].tolist() == [1.0] * 6
    assert res.summary["throughput"]["requests_per_s"] == 2.0  # 6 requests in 3 s
    assert max(res.iterations["num_seqs"]) == 2


def test_a_client_thinks_before_its_next_request(tmp_path):
    res = run_both(closed_loop(tmp_path, [(0.0, 10, 4)] * 3,
                               {"concurrency": 1, "think_time_s": 0.5}))
    assert res.requests["arrival_s"].tolist() == [0.0, 1.5, 3.0]
    assert res.requests["finish_s"].tolist() == [1.0, 2.5, 4.0]


def test_paced_requests_wait_for_their_own_time_and_for_a_client(tmp_path):
    # Due at 0, 0.3 and 2.0; one client: the second waits for the first's answer (1.0), the
    # third for its own time.
    res = run_both(closed_loop(tmp_path, [(0.0, 10, 4), (0.3, 10, 4), (2.0, 10, 4)],
                               {"concurrency": 1, "paced": True}))
    assert res.requests["arrival_s"].tolist() == [0.0, 1.0, 2.0]


def test_the_answer_reaches_the_client_through_the_front_end(tmp_path):
    # The default engine calibration's front end (7.8 ms on one GPU) delays every answer.
    scenario = closed_loop(tmp_path, [(0.0, 10, 4)] * 3, {"concurrency": 1},
                           replica={"engine": "auto"})
    frontend_s = scenario.replica.frontend_latency_s
    assert frontend_s > 0
    res = run_both(scenario)
    arrival = res.requests["arrival_s"].to_numpy()
    assert np.allclose(np.diff(arrival), 1.0 + frontend_s)
    assert np.allclose(res.requests["client_e2e_s"], 1.0 + frontend_s)


def test_a_rejected_request_frees_its_client_at_once(tmp_path):
    # The second needs more KV than the replica has: rejected when sent, at 1.0.
    res = run_both(closed_loop(tmp_path, [(0.0, 10, 4), (0.0, 5000, 4), (0.0, 10, 4)],
                               {"concurrency": 1}, replica={"kv_cache": {
                                   "block_size": 16, "num_blocks": 10}}))
    req = res.requests
    assert req["status"].tolist() == ["finished", "rejected", "finished"]
    assert req["arrival_s"].tolist() == [0.0, 1.0, 1.0]


def test_a_client_that_gave_up_sends_its_next_request_at_the_deadline(tmp_path):
    scenario = parse_scenario({
        "workload": {"format": "vidur", "path": trace(tmp_path, [(0.0, 10, 12), (0.0, 10, 2)]),
                     "timeout_s": 1.1},
        "replica": {**replica(), "engine": "none"}, "clients": {"concurrency": 1},
        "record_token_times": True}, "test")
    res = run_both(scenario)
    req = res.requests
    # The first would take 3 s: given up at 1.1, aborted at the step ending 1.25; the second
    # is sent at 1.1 and starts then.
    assert req["status"].tolist() == ["failed", "finished"]
    assert req["arrival_s"].tolist() == [0.0, 1.1]
    assert req.loc[1, "first_scheduled_s"] == 1.25


def test_requests_never_sent_by_the_horizon_say_so(tmp_path):
    res = run_both(closed_loop(tmp_path, [(0.0, 10, 4)] * 5, {"concurrency": 1},
                               horizon_s=2.5))
    req = res.requests
    assert req["status"].tolist() == ["finished", "finished", "unfinished", "unfinished",
                                      "unfinished"]
    assert req.loc[2, "reason"] == "running_at_horizon"
    for i in (3, 4):
        assert req.loc[i, "reason"] == "after_horizon: never sent (no client free)"
    # Never sent: not offered, so not counted against the SLOs or the arrivals.
    assert res.summary["requests"]["total"] == 5


@pytest.mark.parametrize("cluster", [
    {"replicas": 3, "router": {"name": "least_outstanding"}},
    {"replicas": 2, "router": {"name": "round_robin"}},
    {"prefill": {"replicas": 1, "replica": None}, "decode": {"replicas": 2, "replica": None},
     "router": {"name": "round_robin"}},
])
@pytest.mark.parametrize("clients", [
    {"concurrency": 16},
    {"concurrency": 40, "think_time_s": 0.3, "think_time": "exponential"},
    {"concurrency": 8, "paced": True},
])
def test_clients_fast_forward_as_stepping(cluster, clients):
    rep = {"scheduler": {"name": "vllm_v1", "max_num_seqs": 32},
           "latency": {"kind": "roofline"}, "prefix_caching": True,
           "kv_cache": {"block_size": 16, "num_blocks": 2000}}
    cluster = {**cluster}
    if "prefill" in cluster:
        cluster["prefill"] = {"replicas": 1, "replica": rep}
        cluster["decode"] = {"replicas": 2, "replica": rep}
    data = {"seed": 3, "clients": clients, "cluster": cluster, "record_token_times": True,
            "workload": {"format": "prefix", "num_conversations": 150, "num_requests": 150,
                         "arrivals": {"process": "poisson", "qps": 30},
                         "system_prompt_tokens": 200, "num_groups": 4,
                         "question_tokens": {"dist": "uniform", "low": 20, "high": 400},
                         "output_tokens": {"dist": "uniform", "low": 1, "high": 120},
                         "hash_block_tokens": 16}}
    if "prefill" not in cluster:
        data["replica"] = rep
    res = run_both(parse_scenario(data, "test"))
    req = res.requests
    assert (req["status"] == "finished").all()
    # Never more in flight than there are clients.
    assert max_in_flight(req) <= clients["concurrency"]
    if not clients.get("paced") and not clients.get("think_time_s"):
        assert max_in_flight(req) == clients["concurrency"]


@pytest.mark.parametrize(("field", "value"), [("clients.concurrency", 0),
                                            ("workload.timeout_s", 0)])
def test_a_count_of_clients_or_a_timeout_must_be_positive(tmp_path, monkeypatch, capsys, field,
                                                          value):
    path = tmp_path / "s.yaml"
    path.write_text(f"workload: {{format: vidur, path: {trace(tmp_path, [(0, 5, 5)])}}}\n")
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path), "--out",
                        str(tmp_path / "out"), "--set", f"{field}={value}")
    assert_one_line_error(code, err, field, "greater than 0")


def test_a_capacity_search_of_unpaced_clients_is_refused(tmp_path, monkeypatch, capsys):
    # Unpaced clients send as fast as answers come: the rate searched would change nothing.
    path = tmp_path / "s.yaml"
    path.write_text("workload: {format: synthetic, num_requests: 50, arrivals: {qps: 5}, "
                    "lengths: {prompt: {dist: fixed, value: 50}, "
                    "output: {dist: fixed, value: 10}}}\nclients: {concurrency: 4}\n")
    code, err = run_cli(monkeypatch, capsys, "capacity", str(path), "--tbt-p99", "0.1",
                        "--out", str(tmp_path / "cap"))
    assert_one_line_error(code, err, "s.yaml", "clients.paced=False", "no arrival rate")


@pytest.mark.parametrize(("workload", "field"), [
    ({"rate_scale": 2.0}, "workload.rate_scale"),
    ({"retime": {"process": "poisson", "qps": 3.0}}, "workload.retime"),
])
def test_times_unpaced_clients_would_ignore_are_refused(tmp_path, monkeypatch, capsys,
                                                       workload, field):
    path = tmp_path / "s.yaml"
    trace_path = trace(tmp_path, [(0.0, 5, 5), (1.0, 5, 5)])
    fields = ", ".join(f"{k}: {v}" for k, v in workload.items())
    path.write_text(f"workload: {{format: vidur, path: {trace_path}, {fields}}}\n"
                    "clients: {concurrency: 2}\n")
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path), "--out", str(tmp_path / "o"))
    assert_one_line_error(code, err, "s.yaml", field, "unpaced clients")
    path.write_text(path.read_text().replace("{concurrency: 2}", "{concurrency: 2, paced: true}"))
    code, _ = run_cli_out(monkeypatch, capsys, "simulate", str(path), "--out",
                          str(tmp_path / "o"))
    assert code == 0


def test_clients_stop_sending_after_their_duration(tmp_path):
    # One client, 1 s a request: sent at 0, 1, 2; the duration ends at 2.5, so the request in
    # flight then (sent at 2) is answered and the last two are never sent.
    res = run_both(closed_loop(tmp_path, [(0.0, 10, 4)] * 5,
                               {"concurrency": 1, "duration_s": 2.5}))
    req = res.requests
    assert req["status"].tolist() == ["finished"] * 3 + ["unfinished"] * 2
    assert req["finish_s"].tolist()[:3] == [1.0, 2.0, 3.0]
    for reason in req["reason"].tolist()[3:]:
        assert reason == ("after_duration: never sent, the clients stopped sending at 2.5 s "
                          "(clients.duration_s)")
    # Never sent: not offered, not in the latencies, not an end of the run.
    assert res.summary["ttft_s"]["count"] == 3 and res.summary["run"]["end_s"] == 3.0


def test_a_horizon_before_the_clients_duration_is_the_horizon(tmp_path):
    res = run_both(closed_loop(tmp_path, [(0.0, 10, 4)] * 5,
                               {"concurrency": 1, "duration_s": 10.0}, horizon_s=2.5))
    reasons = res.requests["reason"].tolist()
    assert reasons[2] == "running_at_horizon"
    assert all(r.startswith("after_horizon: never sent") for r in reasons[3:])


def test_warmup_requests_are_served_but_not_measured(tmp_path):
    # Two clients: the first pair (10-token prompts) is the warm-up; the second pair's
    # 40-token prompts take longer to their first token (a budget of 20 tokens an iteration).
    rows = [(0.0, 10, 4), (0.0, 10, 4), (0.0, 40, 4), (0.0, 40, 4)]
    scenario = closed_loop(tmp_path, rows, {"concurrency": 2, "warmup_requests": 2},
                           replica={"scheduler": replica(token_budget=20)["scheduler"]})
    res = run_both(scenario)
    ttft = res.requests["ttft_s"].tolist()
    assert ttft[:2] == [TICK, TICK] and min(ttft[2:]) >= 2 * TICK
    warmup, trimmed = res.summary["warmup"], res.summary["trimmed"]
    assert warmup["method"] == "clients.warmup_requests"
    assert warmup["num_trimmed_requests"] == 2 and warmup["trimmed_until_s"] == 1.0
    assert trimmed["ttft_s"]["count"] == 2
    assert trimmed["ttft_s"]["mean"] == pytest.approx(sum(ttft[2:]) / 2)
    assert trimmed["ttft_s"]["max"] == max(ttft[2:])
    assert res.summary["ttft_s"]["count"] == 4  # the whole run is still reported
    # More warm-up than requests: nothing left to measure, said so.
    scenario = closed_loop(tmp_path, rows, {"concurrency": 2, "warmup_requests": 9})
    res = run_scenario(scenario)
    assert res.summary["trimmed"] is None
    assert res.summary["warmup"]["num_trimmed_requests"] == 4


def test_unpaced_clients_start_empty_and_are_checked_for_a_warm_up(tmp_path):
    scenario = closed_loop(tmp_path, [(0.0, 10, 4)] * 60, {"concurrency": 4})
    warmup = run_scenario(scenario).summary["warmup"]
    assert warmup["method"] == "MSER-5" and warmup["applies"]


def test_rejected_requests_count_as_sent_warm_up(tmp_path):
    # The first two need more KV than there is: rejected when sent, still two of the three
    # warm-up requests (a benchmark counts what it sent).
    rows = [(0.0, 5000, 4)] * 2 + [(0.0, 10, 4)] * 6
    scenario = closed_loop(tmp_path, rows, {"concurrency": 1, "warmup_requests": 3},
                           replica={"kv_cache": {"block_size": 16, "num_blocks": 50}})
    res = run_both(scenario)
    warmup = res.summary["warmup"]
    assert warmup["num_requests"] == 8 and warmup["num_trimmed_requests"] == 3
    assert res.summary["trimmed"]["ttft_s"]["count"] == 5


def test_an_unpaced_closed_loop_is_never_overloaded(tmp_path):
    # 4 clients, 400 requests, 3 s of sending: the queue fills to the clients at the start
    # (an open-loop test would call that growth overload), and can grow no further.
    scenario = closed_loop(tmp_path, [(0.0, 100, 20)] * 400,
                           {"concurrency": 4, "duration_s": 3.0})
    verdict = run_scenario(scenario).summary["overload"]
    assert verdict["verdict"] == "stable" and verdict["detail"].startswith("closed loop")
