"""Latencies over every arrived request (`sim.results.metrics.arrived`, issue 16): unfinished ones
as lower bounds, on known answers, and the table that says which requests it counts."""

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
from sim.results.metrics.warmup import generated_arrivals
from tests.results.test_overload import SERVICE_S, single_server
from tests.results.test_summary import REQUESTS


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
    assert "TTFT ms, engine" in text and "TTFT ms, arrived" in text
    assert "latency rows: finished requests" in text
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
