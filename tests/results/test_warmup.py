"""The start-up transient (`sim.results.metrics.warmup`), found by MSER-5 and trimmed, on known
answers: a step, a trend, a queue that starts full, a stationary queue, overloaded runs with no
steady state, and late cuts after bursts that are no start-up transient."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from sim import run_scenario
from sim.results.metrics.summary import distribution
from sim.results.metrics.warmup import mser, warmup_stats
from tests.results.test_arrived import trace_scenario
from tests.results.test_overload import single_server

# Warm-up: MSER-5.

def test_mser_of_a_step_cuts_at_the_step():
    """100 high values, then a constant: from the 21st batch on the statistic is 0."""
    series = np.concatenate([np.full(100, 5.0), np.zeros(900)])
    assert mser(series) == (20, 200)
    rng = np.random.default_rng(0)
    noisy = series + rng.normal(0, 0.5, series.size)
    d, k = mser(noisy)
    assert 18 <= d <= 22 and k == 200


def test_mser_of_a_trend_lands_in_the_second_half():
    rng = np.random.default_rng(1)
    d, k = mser(np.arange(2000) * 0.01 + rng.normal(0, 1, 2000))
    assert d > k / 2


def test_a_queue_that_starts_full_is_trimmed_where_it_drains(tmp_path):
    """500 requests at t=0, then Poisson arrivals at half capacity: the backlog drains in about
    10 s. MSER-5 trims up to there, and the latencies after it are those of the steady state."""
    rng = np.random.default_rng(0)
    arrival = np.concatenate([np.zeros(500), np.cumsum(rng.exponential(1 / 50, 4000))])
    results = run_scenario(trace_scenario(tmp_path, arrival))
    s, req = results.summary, results.requests
    # A trace: nothing assumed, nothing trimmed.
    assert s["warmup"]["applies"] is False and s["trimmed"] is None
    assert "trace" in s["warmup"]["reason"]
    # As if generated: the first request waiting less than 50 ms ends the transient.
    delay = req["scheduling_delay_s"].to_numpy()
    drained = 500 + int(np.argmax(delay[500:] < 0.05))
    got = warmup_stats(req, s["run"]["end_s"], s["overload"], generated=True)
    warmup, trimmed = got["warmup"], got["trimmed"]
    assert warmup["applies"] and warmup["steady_state"]
    assert abs(warmup["num_trimmed_requests"] - drained) <= 100
    assert warmup["trimmed_until_s"] == arrival[warmup["num_trimmed_requests"]]
    cut = warmup["num_trimmed_requests"]
    assert trimmed["ttft_s"] == {**distribution(req["ttft_s"].to_numpy()[cut:]),
                                 "population": "finished, after warm-up"}
    assert trimmed["scheduling_delay_s"]["mean"] < 0.01 < 0.4 < s["scheduling_delay_s"]["mean"]
    # Every arrival after the cut too, finished or not: here all finished, so the same values.
    after = trimmed["ttft_all_arrived_s"]
    assert after["population"] == "arrived, after warm-up" and after["num_lower_bounds"] == 0
    assert after["count"] == len(arrival) - cut and after["p99"] == trimmed["ttft_s"]["p99"]


def test_a_stationary_queue_trims_little():
    """M/D/1 at 80% load, started empty: a steady state everywhere, and MSER-5 trims under
    5% of the requests in 8 seeds of 10 (seed 2 trims 795 requests: its first 800 hold an
    excursion of the queue quieter later, which MSER takes for a transient)."""
    trims = []
    for seed in range(10):
        s = run_scenario(single_server(80.0, seed)).summary
        assert s["warmup"]["steady_state"] is True, s["warmup"]
        assert s["overload"]["verdict"] == "stable" and "steady_state" not in s["overload"]
        trims.append(s["warmup"]["num_trimmed_requests"])
    assert sum(t < 100 for t in trims) >= 8, trims


def test_trimmed_all_arrived_counts_requests_cut_by_the_horizon(tmp_path):
    """A horizon in the steady state, just after an arrival: the request then in service is
    counted in the trimmed all-arrived population at its time so far (a lower bound); those
    arriving after the horizon are not counted."""
    rng = np.random.default_rng(1)
    arrival = np.concatenate([np.zeros(300), np.cumsum(rng.exponential(1 / 50, 3000))])
    horizon_s = float(arrival[-50]) + 0.001
    results = run_scenario(trace_scenario(tmp_path, arrival, horizon_s=horizon_s))
    s, req = results.summary, results.requests
    got = warmup_stats(req, s["run"]["end_s"], s["overload"], generated=True)
    trimmed, cut = got["trimmed"], got["warmup"]["num_trimmed_requests"]
    assert cut and trimmed is not None
    came = req.sort_values("arrival_s", kind="stable").iloc[cut:]
    came = came[came["arrival_s"] <= horizon_s]
    cut_short = int((came["status"] != "finished").sum())
    after = trimmed["e2e_all_arrived_s"]
    assert cut_short > 0 and after["num_lower_bounds"] == cut_short
    assert after["count"] == len(came) == trimmed["e2e_s"]["count"] + cut_short


@pytest.mark.parametrize("seed", range(3))
def test_an_overloaded_run_has_no_steady_state(seed):
    s = run_scenario(single_server(120.0, seed)).summary
    assert s["overload"]["verdict"] == "overloaded"
    warmup = s["warmup"]
    assert warmup["steady_state"] is False and s["trimmed"] is None
    assert warmup["num_trimmed_requests"] is None
    assert warmup["mser_truncation_requests"] > warmup["num_requests"] / 2  # MSER agrees


def test_no_steady_state_in_a_run_found_stable_is_added_to_the_verdict():
    """A delay growing to the end, with a verdict of `stable`: the verdict stays, its detail
    says MSER-5 found no steady state."""
    n = 500
    frame = pd.DataFrame({"status": "finished", "reason": "", "arrival_s": np.arange(n) * 0.1,
                          "first_token_s": np.nan, "finish_s": np.nan})
    frame["scheduling_delay_s"] = np.arange(n) * 0.01
    frame["first_scheduled_s"] = frame["arrival_s"] + frame["scheduling_delay_s"]
    for col in ("ttft_s", "e2e_s", "max_tbt_s", "tpot_s"):
        frame[col] = 1.0
    verdict = {"verdict": "stable", "detail": "waiting queue grows by little"}
    got = warmup_stats(frame, 100.0, verdict, generated=True)
    assert got["warmup"]["steady_state"] is False and got["trimmed"] is None
    assert got["overload"]["verdict"] == "stable" and got["overload"]["steady_state"] is False
    assert got["overload"]["detail"].startswith("waiting queue grows by little; no steady state")
    assert verdict == {"verdict": "stable", "detail": "waiting queue grows by little"}


def test_too_few_requests_to_look_for_a_warm_up():
    s = run_scenario(single_server(50.0, 0, num_requests=30)).summary
    assert s["warmup"]["applies"] is True and s["warmup"]["steady_state"] is None
    assert s["trimmed"] is None


def test_a_late_cut_after_bursts_is_no_start_up_transient():
    """Delays with bursts in the first part and calm after: MSER-5 cuts after the last burst,
    in the second half; a run starting empty warms up from below, so this is no start-up
    transient: steady, nothing trimmed, the verdict as it was."""
    n = 1000
    rng = np.random.default_rng(0)
    delay = rng.exponential(0.005, n)
    for start in (150, 320, 540):  # three bursts, the last ending past the middle
        delay[start:start + 30] += np.linspace(0.3, 0.0, 30)
    frame = pd.DataFrame({"status": "finished", "reason": "", "arrival_s": np.arange(n) * 0.1,
                          "first_token_s": np.nan, "finish_s": np.nan,
                          "scheduling_delay_s": delay})
    frame["first_scheduled_s"] = frame["arrival_s"] + frame["scheduling_delay_s"]
    for col in ("ttft_s", "e2e_s", "max_tbt_s", "tpot_s"):
        frame[col] = 1.0
    verdict = {"verdict": "stable", "detail": "waiting queue shrinks"}
    got = warmup_stats(frame, 100.0, verdict, generated=True)
    warmup = got["warmup"]
    assert warmup["mser_truncation_requests"] > n / 2  # MSER-5's own cut is late
    assert warmup["steady_state"] is True and warmup["num_trimmed_requests"] == 0
    assert warmup["mser_cut_after_bursts"] is True
    assert got["overload"] == verdict


def test_with_a_prefix_cache_a_late_cut_is_no_steady_state_still():
    """A prefix cache starts cold: its run warms up from above (hits shorten prefills), so a
    late cut with lower delays after it may be that warm-up not over: no steady state."""
    n = 1000
    rng = np.random.default_rng(0)
    delay = rng.exponential(0.005, n)
    for start in (150, 320, 540):
        delay[start:start + 30] += np.linspace(0.3, 0.0, 30)
    frame = pd.DataFrame({"status": "finished", "reason": "", "arrival_s": np.arange(n) * 0.1,
                          "first_token_s": np.nan, "finish_s": np.nan,
                          "scheduling_delay_s": delay, "num_cached_tokens": 0})
    frame.loc[600:, "num_cached_tokens"] = 512
    frame["first_scheduled_s"] = frame["arrival_s"] + frame["scheduling_delay_s"]
    for col in ("ttft_s", "e2e_s", "max_tbt_s", "tpot_s"):
        frame[col] = 1.0
    got = warmup_stats(frame, 100.0, {"verdict": "stable", "detail": "d"}, generated=True)
    assert got["warmup"]["steady_state"] is False and "mser_cut_after_bursts" not in got["warmup"]
