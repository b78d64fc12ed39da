"""Summary metrics on handcrafted records (`sim.results.metrics.summary`): SLO attainment,
counts and throughput, and weighted distributions against the expanded samples."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.config.slo import SLOConfig
from sim.results.metrics.summary import (
    PERCENTILES,
    WeightedSample,
    distribution,
    slo_attainment,
    summarize,
    weighted_percentile,
)


def frame(rows):
    cols = ["status", "reason", "arrival_s", "ttft_s", "max_tbt_s", "finish_s", "tpot_s",
            "e2e_s", "scheduling_delay_s", "num_generated_tokens", "num_preemptions"]
    return pd.DataFrame(rows, columns=cols)


REQUESTS = frame([
    ("finished", "", 0.0, 0.5, 0.05, 2.0, 0.04, 2.0, 0.1, 10, 0),
    ("finished", "", 1.0, 3.0, 0.20, 5.0, 0.10, 4.0, 2.5, 20, 1),
    ("finished", "", 2.0, 0.2, np.nan, 2.2, np.nan, 0.2, 0.0, 1, 0),  # one token: no gap
    ("rejected", "needs 9000 KV slots", 3.0, np.nan, np.nan, np.nan, np.nan, np.nan, np.nan, 0, 0),
])


def test_slo_attainment_counts_unserved_requests_as_misses():
    gaps = np.array([0.05, 0.05, 0.2, 0.1])
    out = slo_attainment(REQUESTS, gaps, SLOConfig(ttft_s=1.0, tbt_s=0.1))
    assert out["ttft_attainment"] == 0.5  # requests 0 and 2 of 4
    assert out["tbt_attainment"] == 0.5  # requests 0 and 2 (no gap) of 4
    assert out["tbt_gap_attainment"] == 0.75
    assert out["all_attainment"] == 0.5
    assert slo_attainment(REQUESTS, gaps, SLOConfig()) == {}


def test_slo_attainment_leaves_out_requests_that_never_arrived():
    """A horizon (or a replay's stop) leaves later requests unoffered: they are in the results
    as unfinished, but no server missed their targets (a run cut at 200 s of 5,000 requests
    read 7.7% TTFT attainment, counting 4,545 of them)."""
    never = frame([
        ("unfinished", "after_horizon: arrives at 9 s", 9.0, *[np.nan] * 6, 0, 0),
        ("unfinished", "after_stop: arrives at 9.5 s, after the replay stopped", 9.5,
         *[np.nan] * 6, 0, 0),
        ("unfinished", "queued_at_horizon: waiting", 4.0, *[np.nan] * 6, 0, 0),
    ])
    gaps = np.array([0.05, 0.05, 0.2, 0.1])
    out = slo_attainment(pd.concat([REQUESTS, never], ignore_index=True), gaps,
                         SLOConfig(ttft_s=1.0, tbt_s=0.1))
    assert out["ttft_attainment"] == 2 / 5  # the queued one arrived: a miss; the others not
    assert out["all_attainment"] == 2 / 5


def test_summary_counts_and_throughput():
    iterations = pd.DataFrame({"start_s": [0.0]})
    s = summarize(REQUESTS, iterations, np.array([0.05, 0.2]), SLOConfig())
    assert s["requests"] == {"total": 4, "finished": 3, "rejected": 1, "failed": 0,
                             "unfinished": 0,
                             "reasons": {"needs 9000 KV slots": 1},
                             "rejected_reasons": {"needs 9000 KV slots": 1}}
    assert s["throughput"]["span_s"] == 5.0
    assert s["throughput"]["requests_per_s"] == pytest.approx(3 / 5)
    assert s["throughput"]["output_tokens_per_s"] == pytest.approx(31 / 5)
    assert s["ttft_s"]["count"] == 3 and s["ttft_s"]["max"] == 3.0
    assert s["num_preemptions"] == 1


def test_distribution_of_nothing():
    assert distribution(np.array([np.nan]))["p99"] is None


# Values with many ties (as TBT gaps of a decode stretch, or a constant latency model) and
# ones one ulp apart; counts include zero.
VALUES = st.one_of(st.sampled_from([0.01, 0.010000000000000002, 0.02, 1e-3, 0.5, 3.0, 0.0]),
                   st.floats(0, 1e3, allow_nan=False, allow_infinity=False))


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(VALUES, st.integers(0, 6)), min_size=1, max_size=30))
def test_weighted_distribution_is_the_expanded_one(pairs):
    values = np.array([v for v, _ in pairs])
    counts = np.array([c for _, c in pairs], dtype=np.int64)
    expanded = np.repeat(values, counts)
    got = distribution(WeightedSample(values, counts))
    want = distribution(expanded)
    # Exactly what np.percentile gives on the expansion; the mean up to rounding.
    mean, expected_mean = got.pop("mean"), want.pop("mean")
    assert mean == (None if expected_mean is None else pytest.approx(expected_mean, rel=1e-12))
    assert got == want
    if expanded.size:
        order = np.argsort(values)
        assert weighted_percentile(values[order], np.cumsum(counts[order]),
                                   PERCENTILES).tolist() == np.percentile(
            expanded, PERCENTILES).tolist()
        for limit in (0.01, 0.5, float(values[0])):
            assert WeightedSample(values, counts).fraction_at_most(limit) == float(
                (expanded <= limit).mean())


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.one_of(VALUES, st.just(np.inf), st.just(np.nan)),
                          st.integers(0, 6)), max_size=30))
def test_distinct_is_the_same_sample_sorted(pairs):
    """The distinct values (read by the summary's percentiles and written as the gaps' file):
    ascending, each once with its total count, none counted zero times; the same expansion."""
    values = np.array([v for v, _ in pairs], dtype=np.float64)
    counts = np.array([c for _, c in pairs], dtype=np.int64)
    distinct = WeightedSample(values, counts).distinct
    finite = np.isfinite(distinct.values)
    assert (np.diff(distinct.values[finite]) > 0).all()
    assert (distinct.counts > 0).all() and distinct.counts.dtype == np.int64
    assert np.array_equal(np.repeat(distinct.values, distinct.counts),
                          np.sort(np.repeat(values, counts)), equal_nan=True)
    # Its distribution is the sample's: the order statistics to the bit, the mean (summed in
    # another order) up to rounding.
    got, want = distribution(distinct), distribution(WeightedSample(values, counts))
    mean, expected_mean = got.pop("mean"), want.pop("mean")
    assert mean == (None if expected_mean is None else pytest.approx(expected_mean, rel=1e-12))
    assert got == want


def test_weighted_percentile_of_large_counts():
    values = np.array([0.001, 0.0125, 0.0126, 0.2])
    counts = np.array([1_000_003, 7, 5_000_011, 13], dtype=np.int64)
    expanded = np.repeat(values, counts)
    assert weighted_percentile(values, np.cumsum(counts), (0, 1, 17, 50, 90, 99, 100)
                               ).tolist() == np.percentile(expanded, (0, 1, 17, 50, 90, 99,
                                                                      100)).tolist()


def test_weighted_sample_skips_what_is_not_finite():
    sample = WeightedSample(np.array([np.nan, 0.1, np.inf, 0.3]), np.array([2, 1, 1, 3]))
    got, want = distribution(sample), distribution(np.repeat(sample.values, sample.counts))
    assert got.pop("mean") == pytest.approx(want.pop("mean"), rel=1e-15)
    assert got == want
    assert distribution(WeightedSample(np.array([np.nan]), np.array([4])))["p50"] is None


def test_slo_attainment_from_counts():
    gaps = WeightedSample(np.array([0.05, 0.2, 0.1]), np.array([2, 1, 1]))
    assert slo_attainment(REQUESTS, gaps, SLOConfig(tbt_s=0.1)) == slo_attainment(
        REQUESTS, np.array([0.05, 0.05, 0.2, 0.1]), SLOConfig(tbt_s=0.1))
    empty = WeightedSample(np.zeros(0), np.zeros(0, dtype=np.int64))
    assert slo_attainment(REQUESTS, empty, SLOConfig(tbt_s=0.1))["tbt_gap_attainment"] is None
