"""Issue 16: latencies over every arrived request (unfinished ones as lower bounds), and the
start-up transient found by MSER-5 and trimmed, on known answers."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim import run_scenario
from sim.cli.common import console
from sim.cli.run import summary_table
from sim.config.scenario import parse_scenario
from sim.results.metrics.arrived import arrived_stats, censored_distribution
from sim.results.metrics.summary import PERCENTILES, distribution
from sim.results.metrics.warmup import generated_arrivals, mser, warmup_stats
from tests.test_metrics import REQUESTS
from tests.test_overload import SERVICE_S, single_server


def trace_scenario(tmp_path, arrival_s: np.ndarray, horizon_s: float | None = None):
    """`single_server` (one 1-token request per 10 ms iteration) replaying these arrivals."""
    trace = tmp_path / "trace.csv"
    pd.DataFrame({"arrived_at": arrival_s, "num_prefill_tokens": 1,
                  "num_decode_tokens": 1}).to_csv(trace, index=False)
    data = single_server(1.0, 0).model_dump()
    data["workload"] = {"format": "vidur", "path": str(trace)}
    data["horizon_s"] = horizon_s
    return parse_scenario(data, "test")


STATS = ["count", "mean", *(f"p{p}" for p in PERCENTILES), "max"]


# Censoring: the all-arrived distributions.

def test_a_horizon_that_cuts_a_queue(tmp_path):
    """400 requests at t=0, served one per 10 ms, cut at 2 s: request i (i < 199) has its
    first token at 10 ms * (i + 1); the 201 others are still waiting at 2 s, each a lower bound
    of 2 s. Over finished requests the median is 1 s; over all arrivals it is at least 2 s."""
    results = run_scenario(trace_scenario(tmp_path, np.zeros(400), horizon_s=2.0))
    s, req = results.summary, results.requests
    finished = (req["status"] == "finished").to_numpy()
    assert finished.sum() == 199 and (req["status"] == "unfinished").sum() == 201
    np.testing.assert_allclose(req["ttft_s"].to_numpy()[finished],
                               SERVICE_S * np.arange(1, 200), rtol=0, atol=1e-12)

    # The headline, as before, says which requests it counts.
    assert s["ttft_s"]["population"] == "finished" and s["ttft_s"]["count"] == 199
    assert s["ttft_s"]["p50"] == pytest.approx(1.0)

    # All arrived: the hand-built sample, its percentiles numpy's.
    first_token = req["first_token_s"].to_numpy()
    censored = np.isnan(first_token)
    assert censored.sum() == 201
    sample = np.where(censored, 2.0, first_token)  # arrivals at 0
    got = s["ttft_all_arrived_s"]
    assert got["population"] == "arrived" and got["num_lower_bounds"] == 201
    assert got["count"] == 400
    assert [got[f"p{p}"] for p in PERCENTILES] == np.percentile(sample, PERCENTILES).tolist()
    assert got["p50"] == 2.0 and got["max"] == 2.0
    assert got["mean"] == pytest.approx(sample.mean(), rel=1e-15)
    assert all(got["is_lower_bound"].values())
    # Every lower bound unbounded: the median and above would be too.
    assert got["at_most"] == {"p50": None, "p90": None, "p99": None}
    # E2E (one token: finish = first token) and scheduling delay alike.
    assert s["e2e_all_arrived_s"]["p50"] == 2.0
    assert s["e2e_all_arrived_s"]["num_lower_bounds"] == 201
    assert s["scheduling_delay_all_arrived_s"]["num_lower_bounds"] == int(
        req["first_scheduled_s"].isna().sum())


def test_lower_bounds_from_a_queue_of_steady_arrivals(tmp_path):
    """Arrivals at twice capacity, cut at 1 s: the requests still waiting arrived last, so
    their lower bounds (1 s - arrival) are small; requests after the horizon are not counted."""
    arrival = np.arange(400) / 200
    results = run_scenario(trace_scenario(tmp_path, arrival, horizon_s=1.0))
    req = results.requests
    arrived = arrival < 1.0
    first_token = req["first_token_s"].to_numpy()
    sample = np.where(np.isnan(first_token), 1.0 - arrival, first_token - arrival)[arrived]
    got = results.summary["ttft_all_arrived_s"]
    assert got["count"] == 200 == arrived.sum()
    assert got["num_lower_bounds"] == int(np.isnan(first_token[arrived]).sum()) > 90
    assert [got[f"p{p}"] for p in PERCENTILES] == np.percentile(sample, PERCENTILES).tolist()
    assert results.summary["requests"]["reasons"]["after_horizon"] == 200


def test_percentiles_of_a_hand_built_lower_bound_sample():
    values = np.array([1.0, 2.0, 3.0, 4.0, 100.0])
    # The censored value above the median cannot move it: only P90 and up are lower bounds.
    got = censored_distribution(values, np.array([False, False, False, False, True]))
    assert [got[f"p{p}"] for p in PERCENTILES] == np.percentile(values, PERCENTILES).tolist()
    assert got["num_lower_bounds"] == 1
    assert got["is_lower_bound"] == {"mean": True, "p50": False, "p90": True, "p99": True,
                                     "max": True}
    assert got["at_most"] == {"p50": 3.0, "p90": None, "p99": None}
    # One below the median: it could rise past it.
    got = censored_distribution(values, np.array([True, False, False, False, False]))
    assert got["is_lower_bound"] == dict.fromkeys(["mean", "p50", "p90", "p99", "max"], True)
    # Raised without bound: [2, 3, 4, 100, inf], P90 and P99 between 100 and inf.
    assert got["at_most"] == {"p50": 4.0, "p90": None, "p99": None}
    got = censored_distribution(np.arange(11.0), np.arange(11) == 0)
    assert got["at_most"] == {"p50": 6.0, "p90": 10.0, "p99": None}
    # None censored: the plain distribution.
    got = censored_distribution(values, np.zeros(5, dtype=bool))
    assert {k: got[k] for k in STATS} == distribution(values)
    assert not any(got["is_lower_bound"].values()) and got["num_lower_bounds"] == 0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0.0, 1.0, 2.0, 2.5, 7.0]) | st.floats(0, 10),
                          st.booleans(), st.floats(0, 20)), min_size=1, max_size=25))
def test_lower_bound_marks_are_right(rows):
    """Raising the censored values never lowers a percentile, moves one not marked a lower
    bound not at all, and never past `at_most`."""
    values = np.array([v for v, _, _ in rows])
    censored = np.array([c for _, c, _ in rows])
    raised = values + np.where(censored, [r for _, _, r in rows], 0.0)
    got = censored_distribution(values, censored)
    true = np.percentile(raised, PERCENTILES)
    for p, q in zip(PERCENTILES, true, strict=True):
        shown = got[f"p{p}"]
        assert q >= shown - 1e-12
        if not got["is_lower_bound"][f"p{p}"]:
            assert q == pytest.approx(shown, abs=1e-12)
        bound = got["at_most"][f"p{p}"]
        if bound is not None:
            assert q <= bound + 1e-12


def test_no_unfinished_requests_gives_the_finished_distributions():
    s = run_scenario(single_server(80.0, 0)).summary
    assert s["requests"]["unfinished"] == 0
    for key in ("ttft", "e2e", "scheduling_delay"):
        arrived, finished = s[f"{key}_all_arrived_s"], s[f"{key}_s"]
        assert {k: arrived[k] for k in STATS} == {k: finished[k] for k in STATS}
        assert arrived["num_lower_bounds"] == 0 and not any(arrived["is_lower_bound"].values())


def test_rejected_requests_are_not_arrivals():
    """A rejected request is counted apart (`requests.rejected`), never as a latency."""
    got = arrived_stats(REQUESTS.assign(first_token_s=REQUESTS["arrival_s"] + REQUESTS["ttft_s"],
                                        first_scheduled_s=np.nan), end_s=5.0)
    assert got["ttft_all_arrived_s"]["count"] == 3
    assert got["ttft_all_arrived_s"]["num_lower_bounds"] == 0
    assert got["ttft_all_arrived_s"]["p50"] == 0.5


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


def test_which_arrivals_are_generated(tmp_path):
    assert generated_arrivals(single_server(80.0, 0).workload)
    assert not generated_arrivals(trace_scenario(tmp_path, np.zeros(3)).workload)
    lengths = tmp_path / "lengths.csv"
    lengths.write_text("num_prefill_tokens,num_decode_tokens\n5,5\n")
    assert generated_arrivals(parse_scenario({"workload": {
        "format": "lengths", "path": str(lengths), "arrivals": {"qps": 1.0}}}, "t").workload)


def test_the_table_says_which_requests_it_counts(tmp_path):
    s = run_scenario(trace_scenario(tmp_path, np.zeros(400), horizon_s=2.0)).summary
    with console.capture() as capture:
        console.print(summary_table(s), width=80)
    text = capture.get()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "TTFT ms, finished" in text and "TTFT ms, arrived" in text
    assert ">=2,000" in text  # the all-arrived median, a lower bound, in ms
    assert "warm-up: none assumed (replayed trace)" in text
    s = run_scenario(single_server(80.0, 2)).summary
    with console.capture() as capture:
        console.print(summary_table(s), width=80)
    text = capture.get()
    assert "TTFT ms, arrived" not in text  # the same requests as the finished row
    assert "first 795 of 2,000 requests trimmed" in text


def test_the_table_fits_80_columns_with_the_widest_numbers(tmp_path):
    s = run_scenario(trace_scenario(tmp_path, np.zeros(400), horizon_s=2.0)).summary
    for key in ("ttft_s", "ttft_all_arrived_s", "scheduling_delay_s"):  # minutes, in ms
        s[key] = {k: v * 123.4 if isinstance(v, float) else v for k, v in s[key].items()}
    s["requests"]["unfinished"] = 10**6
    with console.capture() as capture:
        console.print(summary_table(s), width=80)
    text = capture.get()
    assert "…" not in text and ">=246,800" in text and "123,400" in text
    assert max(len(line) for line in text.splitlines()) <= 80


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
